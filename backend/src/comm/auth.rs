//! The job secret and the handshake that every store and peer connection runs before anything
//! else: a mutual challenge–response, HMAC-SHA256 keyed by the secret.
//!
//! ```text
//! server → client   MAGIC, n_s                         (16 random bytes each way)
//! client → server   n_c, HMAC(k, "client" ‖ n_s ‖ n_c)
//! server → client   HMAC(k, "server" ‖ n_c ‖ n_s)         (only if the client's tag was right)
//! ```
//!
//! Each side proves it holds `k` on a nonce the other chose, so a recorded exchange cannot be
//! replayed, and neither side learns anything about `k` it could reuse. The connection is
//! authenticated when it opens; what follows is neither encrypted nor signed (see the guide's
//! "Security" section). A job without a secret runs the same exchange with an empty key: any
//! client that speaks the protocol gets in, as before there were secrets.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::error::CommError;

/// Environment variable: the job's secret, shared by every rank (and every launcher of a
/// multi-node job). `wildfire launch` generates one for a single-node job.
pub const JOB_TOKEN_ENV: &str = "WILDFIRE_JOB_TOKEN";

/// How long a peer has to finish the handshake once connected.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

const MAGIC: [u8; 8] = *b"wfauth1\0";
const NONCE: usize = 16;
const TAG: usize = 32;

/// The job's secret (empty: none).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct JobToken(Vec<u8>);

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        match self.0.is_empty() {
            true => f.write_str("JobToken(none)"),
            false => f.write_str("JobToken(set)"),
        }
    }
}

impl JobToken {
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        Self(secret.into())
    }

    /// The secret in [`JOB_TOKEN_ENV`], if set and not empty.
    pub fn from_env() -> Option<Self> {
        secret_in_env().map(Self::new)
    }

    /// 32 random bytes from the operating system, as 64 hex digits (fit for an environment
    /// variable).
    pub fn generate() -> io::Result<String> {
        random_hex::<32>()
    }

    /// HMAC(k, role ‖ first ‖ second), before finalising.
    fn mac(&self, role: &[u8], first: &[u8], second: &[u8]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(role);
        mac.update(first);
        mac.update(second);
        mac
    }

    fn tag(&self, role: &[u8], first: &[u8], second: &[u8]) -> [u8; TAG] {
        self.mac(role, first, second).finalize().into_bytes().into()
    }

    /// Whether `tag` is [`Self::tag`]'s, compared in constant time.
    fn verify(&self, role: &[u8], first: &[u8], second: &[u8], tag: &[u8]) -> bool {
        self.mac(role, first, second).verify_slice(tag).is_ok()
    }
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("it does not hold the job's secret ({JOB_TOKEN_ENV})")]
    WrongSecret,
    #[error("it does not speak the wildfire handshake")]
    NotWildfire,
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Runs `f` with `timeout` on every read and write of `stream`, then clears it.
fn within<T>(
    stream: &mut TcpStream,
    timeout: Duration,
    f: impl FnOnce(&mut TcpStream) -> Result<T, HandshakeError>,
) -> Result<T, HandshakeError> {
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let result = f(stream);
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    result
}

/// The value of [`JOB_TOKEN_ENV`], if set and not empty.
pub fn secret_in_env() -> Option<String> {
    std::env::var(JOB_TOKEN_ENV)
        .ok()
        .filter(|value| !value.is_empty())
}

/// `N` random bytes from the operating system.
fn random_bytes<const N: usize>() -> io::Result<[u8; N]> {
    let mut bytes = [0u8; N];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes)
}

/// `N` random bytes from the operating system, as `2N` hex digits.
pub(crate) fn random_hex<const N: usize>() -> io::Result<String> {
    Ok(random_bytes::<N>()?
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The accepting side: challenges the client, checks its answer, then proves itself.
pub fn accept_handshake(
    stream: &mut TcpStream,
    token: &JobToken,
    timeout: Duration,
) -> Result<(), HandshakeError> {
    within(stream, timeout, |stream| {
        let server_nonce = random_bytes::<NONCE>()?;
        stream.write_all(&[MAGIC.as_slice(), &server_nonce].concat())?;
        let mut answer = [0u8; NONCE + TAG];
        stream.read_exact(&mut answer).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => HandshakeError::NotWildfire,
            _ => HandshakeError::Io(e),
        })?;
        let (client_nonce, tag) = answer.split_at(NONCE);
        if !token.verify(b"client", &server_nonce, client_nonce, tag) {
            return Err(HandshakeError::WrongSecret);
        }
        stream.write_all(&token.tag(b"server", client_nonce, &server_nonce))?;
        Ok(())
    })
}

/// The connecting side: answers the server's challenge, then checks the server's proof.
pub fn connect_handshake(
    stream: &mut TcpStream,
    token: &JobToken,
    timeout: Duration,
) -> Result<(), HandshakeError> {
    within(stream, timeout, |stream| {
        let mut challenge = [0u8; MAGIC.len() + NONCE];
        stream.read_exact(&mut challenge)?;
        let (magic, server_nonce) = challenge.split_at(MAGIC.len());
        if magic != MAGIC {
            return Err(HandshakeError::NotWildfire);
        }
        let client_nonce = random_bytes::<NONCE>()?;
        let tag = token.tag(b"client", server_nonce, &client_nonce);
        stream.write_all(&[client_nonce.as_slice(), &tag].concat())?;
        let mut proof = [0u8; TAG];
        // A server that refused us closes the connection instead of answering.
        stream
            .read_exact(&mut proof)
            .map_err(|_| HandshakeError::WrongSecret)?;
        match token.verify(b"server", &client_nonce, server_nonce, &proof) {
            true => Ok(()),
            false => Err(HandshakeError::WrongSecret),
        }
    })
}

/// A failed handshake on a connection this rank opened, as the job's error.
pub fn refused(to: &str, error: HandshakeError) -> CommError {
    CommError::Rendezvous(format!("{to} refused this rank's handshake: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair(server: JobToken, client: JobToken) -> (Result<(), String>, Result<(), String>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepting = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            accept_handshake(&mut stream, &server, Duration::from_secs(5))
                .map_err(|e| e.to_string())
        });
        let mut stream = TcpStream::connect(addr).unwrap();
        let connected = connect_handshake(&mut stream, &client, Duration::from_secs(5))
            .map_err(|e| e.to_string());
        drop(stream);
        (accepting.join().unwrap(), connected)
    }

    #[test]
    fn the_same_secret_passes_both_ways_and_another_is_refused_both_ways() {
        let secret = JobToken::new(JobToken::generate().unwrap());
        assert_eq!(pair(secret.clone(), secret.clone()), (Ok(()), Ok(())));
        let (server, client) = pair(secret.clone(), JobToken::new("guess"));
        assert!(server.unwrap_err().contains(JOB_TOKEN_ENV));
        assert!(client.is_err());
        let (server, client) = pair(secret, JobToken::default());
        assert!(server.is_err() && client.is_err());
    }

    #[test]
    fn a_secret_is_never_printed() {
        let token = JobToken::new("hunter2");
        assert_eq!(format!("{token:?}"), "JobToken(set)");
        assert_eq!(JobToken::generate().unwrap().len(), 64);
    }
}
