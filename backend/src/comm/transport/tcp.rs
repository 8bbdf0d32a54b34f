//! The `tcp` transport: one process per rank, one TCP connection per pair of ranks.
//!
//! Ranks find each other through the rendezvous store: each publishes the address of its own
//! listener, connects to every lower rank and accepts every higher one. Each connection has a
//! writer thread (sends return at once and a collective's sends overlap its receives) and a reader
//! thread that decodes frames into the mailbox. A broken connection marks the peer lost, so
//! pending and later receives from it fail at once instead of waiting for the deadline.
//!
//! Frames are `transport::frame`'s.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Transport;
use super::frame::{frame_head, read_head, read_payload};
use crate::comm::auth::{
    HANDSHAKE_TIMEOUT, JobToken, accept_handshake, connect_handshake, refused,
};
use crate::comm::error::CommError;
use crate::comm::mailbox::{Mailbox, Message};
use crate::comm::store::{StoreClient, log_refusal};

const HELLO_MAGIC: u32 = 0x5746_4831; // "WFH1"
/// Pieces of this size keep both cores busy: one receives while the other reduces (1, 4 and
/// 0.25 MiB measured alike within noise on the 2-core reference machine; 4 MiB was best at 64 MiB).
const PIECE_BYTES: usize = 4 << 20;

struct Peer {
    queue: Option<mpsc::Sender<Message>>,
    stream: TcpStream,
    writer: Option<JoinHandle<()>>,
}

pub(crate) struct TcpTransport {
    rank: usize,
    world_size: usize,
    peers: Vec<Option<Peer>>,
    mailbox: Arc<Mailbox>,
}

impl TcpTransport {
    /// Connects this rank to every other rank, using `store` to exchange addresses.
    /// Every connection passes the handshake with `token` before its first byte of data.
    pub(crate) fn connect(
        rank: usize,
        world_size: usize,
        local_world_size: usize,
        store: &StoreClient,
        timeout: Duration,
        token: &JobToken,
    ) -> Result<Self, CommError> {
        let deadline = Instant::now() + timeout;
        let ip = advertised_ip(store, world_size, local_world_size)?;
        let bind = bind_ip()?.unwrap_or(ip);
        let listener = TcpListener::bind((bind, 0))
            .map_err(|e| CommError::io(format!("binding this rank's listener on {bind}"), e))?;
        let port = listener
            .local_addr()
            .map_err(|e| CommError::io("reading this rank's listener address", e))?
            .port();
        store.set(&peer_key(rank), format!("{ip}:{port}").as_bytes())?;
        wait_for_everyone(store, world_size, timeout)?;

        let mailbox = Arc::new(Mailbox::default());
        let mut peers: Vec<Option<Peer>> = (0..world_size).map(|_| None).collect();
        for (peer, slot) in peers.iter_mut().enumerate().take(rank) {
            let stream = dial(store, rank, world_size, peer, deadline, token)?;
            *slot = Some(start_peer(stream, rank, peer, &mailbox)?);
        }
        for (stream, peer) in accept_higher_ranks(&listener, rank, world_size, token, deadline)? {
            peers[peer] = Some(start_peer(stream, rank, peer, &mailbox)?);
        }
        Ok(Self {
            rank,
            world_size,
            peers,
            mailbox,
        })
    }
}

/// Environment variable: the address this rank publishes for its peers (default: the local
/// address of its connection to the store).
pub const ADVERTISE_ENV: &str = "WILDFIRE_ADVERTISE_ADDR";

/// Environment variable: the address the store (rank 0) and every rank's listener bind, instead
/// of `MASTER_ADDR`'s and the advertised one; `0.0.0.0` binds every interface.
pub const BIND_ENV: &str = "WILDFIRE_BIND";

/// The address in [`BIND_ENV`], if set.
pub(crate) fn bind_ip() -> Result<Option<std::net::IpAddr>, CommError> {
    let Ok(value) = std::env::var(BIND_ENV) else {
        return Ok(None);
    };
    value
        .trim()
        .parse()
        .map(Some)
        .map_err(|_| CommError::Rendezvous(format!("{BIND_ENV}={value:?} is not an IP address")))
}

/// The address peers should dial. A loopback address is refused when the job spans hosts (an
/// /etc/hosts entry mapping the host name to 127.0.1.1 is the usual cause).
fn advertised_ip(
    store: &StoreClient,
    world_size: usize,
    local_world_size: usize,
) -> Result<std::net::IpAddr, CommError> {
    if let Ok(value) = std::env::var(ADVERTISE_ENV) {
        return value.trim().parse().map_err(|_| {
            CommError::Rendezvous(format!("{ADVERTISE_ENV}={value:?} is not an IP address"))
        });
    }
    let ip = store.local_ip()?;
    if ip.is_loopback() && world_size > local_world_size {
        return Err(CommError::Rendezvous(format!(
            "this rank reaches the store through loopback ({ip}) but the job spans hosts \
             ({world_size} ranks, {local_world_size} on this one): set MASTER_ADDR to an address \
             other hosts can reach, or {ADVERTISE_ENV} to this host's address"
        )));
    }
    Ok(ip)
}

fn peer_key(rank: usize) -> String {
    format!("wildfire/peer/{rank}")
}

/// Waits until every rank has published its address; names the ones that never did.
fn wait_for_everyone(
    store: &StoreClient,
    world_size: usize,
    timeout: Duration,
) -> Result<(), CommError> {
    store.add("wildfire/arrived", 1)?;
    if store.wait_at_least("wildfire/arrived", world_size as i64)? {
        return Ok(());
    }
    let mut missing = Vec::new();
    for rank in 0..world_size {
        if store.get_within(&peer_key(rank), Duration::ZERO)?.is_none() {
            missing.push(rank);
        }
    }
    Err(CommError::Rendezvous(format!(
        "rank(s) {missing:?} of {world_size} never arrived within {:.1} s",
        timeout.as_secs_f64()
    )))
}

fn dial(
    store: &StoreClient,
    rank: usize,
    world_size: usize,
    peer: usize,
    deadline: Instant,
    token: &JobToken,
) -> Result<TcpStream, CommError> {
    let addr = store
        .get(&peer_key(peer))?
        .ok_or_else(|| CommError::Rendezvous(format!("rank {peer} never published its address")))?;
    let addr = String::from_utf8_lossy(&addr).into_owned();
    let unreachable = |e: String| {
        CommError::Rendezvous(format!(
            "rank {rank} cannot connect to rank {peer} at {addr}: {e}"
        ))
    };
    let target: std::net::SocketAddr = addr.parse().map_err(|e| unreachable(format!("{e}")))?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    let mut stream =
        TcpStream::connect_timeout(&target, left).map_err(|e| unreachable(e.to_string()))?;
    connect_handshake(&mut stream, token, HANDSHAKE_TIMEOUT)
        .map_err(|e| refused(&format!("rank {peer} at {addr}"), e))?;
    let mut hello = HELLO_MAGIC.to_le_bytes().to_vec();
    hello.extend_from_slice(&(rank as u64).to_le_bytes());
    hello.extend_from_slice(&(world_size as u64).to_le_bytes());
    stream
        .write_all(&hello)
        .map_err(|e| CommError::io(format!("greeting rank {peer} at {addr}"), e))?;
    Ok(stream)
}

/// Accepts until every rank above `rank` has connected. Each connection passes the handshake
/// and says which rank it is on a thread of its own, so an idle or hostile one cannot hold up
/// the others; one that fails either (logged by its thread, whenever it fails) or claims a rank
/// that is not a higher one still missing is dropped, and the rendezvous goes on.
fn accept_higher_ranks(
    listener: &TcpListener,
    rank: usize,
    world_size: usize,
    token: &JobToken,
    deadline: Instant,
) -> Result<Vec<(TcpStream, usize)>, CommError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::io("configuring the listener", e))?;
    let (greeted, greetings) = mpsc::channel();
    let mut peers: Vec<(TcpStream, usize)> = Vec::new();
    while peers.len() < world_size - rank - 1 {
        match listener.accept() {
            Ok((mut stream, from)) => {
                let (greeted, token) = (greeted.clone(), token.clone());
                let _ = std::thread::Builder::new()
                    .name("wildfire-greet".into())
                    .spawn(move || match greet(&mut stream, &token, world_size) {
                        Ok(peer) => {
                            let _ = greeted.send((from, stream, peer));
                        }
                        Err(why) => log_refusal(Some(from), &why),
                    });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(CommError::io("accepting a peer connection", e)),
        }
        for (from, stream, peer) in greetings.try_iter() {
            if peer > rank && !peers.iter().any(|(_, p)| *p == peer) {
                peers.push((stream, peer));
            } else {
                log_refusal(
                    Some(from),
                    &format!("it says it is rank {peer}, not a higher rank still missing"),
                );
            }
        }
        if Instant::now() >= deadline {
            return Err(CommError::Rendezvous(format!(
                "timed out waiting for higher ranks to connect ({} of {} arrived)",
                peers.len(),
                world_size - rank - 1
            )));
        }
    }
    Ok(peers)
}

/// The handshake and the greeting of an accepted connection: the rank it says it is.
fn greet(stream: &mut TcpStream, token: &JobToken, world_size: usize) -> Result<usize, String> {
    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
    accept_handshake(stream, token, HANDSHAKE_TIMEOUT).map_err(|e| e.to_string())?;
    let mut hello = [0u8; 20];
    stream
        .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .and_then(|()| stream.read_exact(&mut hello))
        .and_then(|()| stream.set_read_timeout(None))
        .map_err(|e| format!("no greeting: {e}"))?;
    let magic = u32::from_le_bytes(hello[0..4].try_into().unwrap_or_default());
    let peer = u64::from_le_bytes(hello[4..12].try_into().unwrap_or_default()) as usize;
    let their_world = u64::from_le_bytes(hello[12..20].try_into().unwrap_or_default()) as usize;
    if magic != HELLO_MAGIC || their_world != world_size || peer >= world_size {
        return Err(format!(
            "not a rank of this job (rank {peer}, world size {their_world}, expected world \
             size {world_size})"
        ));
    }
    Ok(peer)
}

fn start_peer(
    stream: TcpStream,
    rank: usize,
    peer: usize,
    mailbox: &Arc<Mailbox>,
) -> Result<Peer, CommError> {
    stream
        .set_nodelay(true)
        .map_err(|e| CommError::io("configuring a peer connection", e))?;
    let clone = || {
        stream
            .try_clone()
            .map_err(|e| CommError::io("cloning a peer connection", e))
    };
    let (reader_stream, writer_stream) = (clone()?, clone()?);
    let reader_mailbox = mailbox.clone();
    std::thread::Builder::new()
        .name(format!("wildfire-recv-{peer}"))
        .spawn(move || read_loop(reader_stream, peer, &reader_mailbox))
        .map_err(|e| CommError::io("starting a reader thread", e))?;
    let (queue, outgoing) = mpsc::channel();
    let writer_mailbox = mailbox.clone();
    let writer = std::thread::Builder::new()
        .name(format!("wildfire-send-{peer}"))
        .spawn(move || write_loop(writer_stream, rank, peer, &outgoing, &writer_mailbox))
        .map_err(|e| CommError::io("starting a writer thread", e))?;
    Ok(Peer {
        queue: Some(queue),
        stream,
        writer: Some(writer),
    })
}

fn read_loop(stream: TcpStream, peer: usize, mailbox: &Mailbox) {
    let mut reader = BufReader::with_capacity(1 << 16, stream);
    loop {
        match read_frame(&mut reader) {
            Ok(message) => mailbox.deliver(peer, message),
            Err(e) => {
                // Close the connection so the peer's writer fails at once instead of blocking.
                let _ = reader.get_ref().shutdown(Shutdown::Both);
                let reason = if e.kind() == io::ErrorKind::UnexpectedEof {
                    format!("rank {peer} closed its connection (process exited?)")
                } else {
                    format!("connection to rank {peer} failed: {e}")
                };
                mailbox.mark_lost(peer, reason);
                return;
            }
        }
    }
}

fn write_loop(
    mut stream: TcpStream,
    rank: usize,
    peer: usize,
    outgoing: &mpsc::Receiver<Message>,
    mailbox: &Mailbox,
) {
    for message in outgoing {
        if let Err(e) = write_frame(&mut stream, &message) {
            mailbox.mark_lost(
                peer,
                format!("rank {rank} could not send to rank {peer}: {e}"),
            );
            return;
        }
    }
    let _ = stream.flush();
}

fn write_frame(stream: &mut TcpStream, message: &Message) -> io::Result<()> {
    stream.write_all(&frame_head(message))?;
    stream.write_all(message.payload.bytes())
}

fn read_frame(r: &mut BufReader<TcpStream>) -> io::Result<Message> {
    let head = read_head(r)?;
    read_payload(head, |dst, len| read_raw(r, dst, len))
}

/// Reads `len` bytes to `dst` without initialising it first: the buffered bytes, then
/// `read(2)` straight into it.
fn read_raw(r: &mut BufReader<TcpStream>, dst: *mut u8, len: usize) -> io::Result<()> {
    let buffered = r.buffer();
    let mut filled = buffered.len().min(len);
    // SAFETY: `dst` has room for `len` bytes and `filled <= len`; the buffers do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(buffered.as_ptr(), dst, filled) };
    r.consume(filled);
    let fd = r.get_ref().as_raw_fd();
    while filled < len {
        // SAFETY: writes at most `len - filled` bytes into the rest of `dst`.
        let got = unsafe { libc::read(fd, dst.add(filled).cast(), len - filled) };
        match got {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n if n > 0 => filled += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn name(&self) -> &'static str {
        "tcp"
    }
    fn shares_memory(&self) -> bool {
        false
    }
    fn piece_bytes(&self) -> usize {
        PIECE_BYTES
    }
    fn send(&self, dst: usize, message: Message) -> Result<(), String> {
        if let Some(reason) = self.mailbox.lost_reason(dst) {
            return Err(reason);
        }
        let queue = self.peers[dst]
            .as_ref()
            .and_then(|p| p.queue.as_ref())
            .ok_or_else(|| format!("no connection to rank {dst}"))?;
        queue
            .send(message)
            .map_err(|_| format!("the sender to rank {dst} has stopped"))
    }
    fn mailbox(&self) -> &Mailbox {
        &self.mailbox
    }
}

impl Drop for TcpTransport {
    /// Flushes queued messages (bounded wait), then closes every connection.
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        for peer in self.peers.iter_mut().flatten() {
            peer.queue = None;
        }
        for peer in self.peers.iter_mut().flatten() {
            if let Some(writer) = peer.writer.take() {
                while !writer.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            let _ = peer.stream.shutdown(Shutdown::Both);
        }
    }
}
