//! The rendezvous key-value store: rank 0 serves it at MASTER_ADDR:MASTER_PORT, every rank
//! (rank 0 included) talks to it as a client. Ranks publish their addresses in it, wait for each
//! other, and later exchange the NCCL unique id through it.
//!
//! Wire format: a request is an op byte followed by length-prefixed fields; a response is a status
//! byte followed by a length-prefixed value. Integers are little-endian. Blocking requests carry
//! their own timeout, so the server never waits longer than the client.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::auth::{HANDSHAKE_TIMEOUT, JobToken, accept_handshake, connect_handshake, refused};
use super::error::CommError;

/// Most store connections served at once; more are dropped as they arrive (a job needs one
/// per rank).
pub const MAX_STORE_CONNECTIONS: usize = 1024;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_WAIT_AT_LEAST: u8 = 4;

const STATUS_OK: u8 = 0;
const STATUS_TIMEOUT: u8 = 1;
const STATUS_BAD_REQUEST: u8 = 2;

#[derive(Default)]
struct Table {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl Table {
    fn set(&self, key: String, value: Vec<u8>) {
        self.values
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, value);
        self.changed.notify_all();
    }

    fn add(&self, key: String, delta: i64) -> Result<i64, String> {
        let mut values = self.values.lock().unwrap_or_else(|e| e.into_inner());
        let current = match values.get(&key) {
            Some(v) => parse_counter(&key, v)?,
            None => 0,
        };
        let next = current.wrapping_add(delta);
        values.insert(key, next.to_string().into_bytes());
        drop(values);
        self.changed.notify_all();
        Ok(next)
    }

    /// Waits until `ready` holds for the key's value, or the timeout passes.
    fn wait_for(
        &self,
        key: &str,
        timeout: Duration,
        ready: impl Fn(&[u8]) -> bool,
    ) -> Option<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut values = self.values.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(v) = values.get(key)
                && ready(v)
            {
                return Some(v.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            values = self
                .changed
                .wait_timeout(values, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

fn parse_counter(key: &str, value: &[u8]) -> Result<i64, String> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("store key {key:?} does not hold a counter"))
}

/// The server side, run by rank 0 on background threads for the life of the process.
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
}

impl StoreServer {
    /// Binds `ip:port` and serves until the process exits. Every connection must pass the
    /// handshake with `token` first; one that does not, or does not finish it within
    /// [`HANDSHAKE_TIMEOUT`], is dropped and logged, and the store goes on.
    pub fn start(ip: IpAddr, port: u16, token: JobToken) -> Result<Self, CommError> {
        let listener = TcpListener::bind((ip, port)).map_err(|e| {
            if e.kind() == io::ErrorKind::AddrInUse {
                CommError::Rendezvous(format!(
                    "rendezvous port {port} is already in use on this host: another job or \
                     process holds it; pick a free one with --master-port or MASTER_PORT"
                ))
            } else if e.kind() == io::ErrorKind::AddrNotAvailable {
                CommError::Rendezvous(format!(
                    "cannot serve the rendezvous store on {ip}: it is not an address of this host \
                     (MASTER_ADDR must name rank 0's host; or set WILDFIRE_BIND)"
                ))
            } else {
                CommError::Rendezvous(format!(
                    "cannot serve the rendezvous store on {ip} port {port}: {e}"
                ))
            }
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| CommError::io("reading the store's address", e))?;
        let table = Arc::new(Table::default());
        let token = Arc::new(token);
        let open = Arc::new(AtomicUsize::new(0));
        std::thread::Builder::new()
            .name("wildfire-store".into())
            .spawn(move || {
                for mut stream in listener.incoming().flatten() {
                    let from = stream.peer_addr().ok();
                    if open.fetch_add(1, Ordering::SeqCst) >= MAX_STORE_CONNECTIONS {
                        open.fetch_sub(1, Ordering::SeqCst);
                        log_refusal(from, "too many open connections");
                        continue;
                    }
                    let (table, token, closing) = (table.clone(), token.clone(), open.clone());
                    let served = std::thread::Builder::new()
                        .name("wildfire-store-client".into())
                        .spawn(move || {
                            match accept_handshake(&mut stream, &token, HANDSHAKE_TIMEOUT) {
                                Ok(()) => serve_client(stream, &table),
                                Err(error) => log_refusal(from, &error.to_string()),
                            }
                            closing.fetch_sub(1, Ordering::SeqCst);
                        });
                    if served.is_err() {
                        open.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            })
            .map_err(|e| CommError::io("starting the store thread", e))?;
        Ok(Self { addr })
    }

    /// The bound address (its port is the real one when started with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Says on stderr that a connection from `from` was dropped, and why (the job goes on).
pub(crate) fn log_refusal(from: Option<SocketAddr>, why: &str) {
    let from = from.map_or_else(|| "an unknown address".to_string(), |a| a.to_string());
    eprintln!("wildfire: refused a connection from {from}: {why}");
}

fn serve_client(mut stream: TcpStream, table: &Table) {
    let _ = stream.set_nodelay(true);
    while let Ok(op) = read_u8(&mut stream) {
        let reply = handle_request(op, &mut stream, table);
        let (status, value) = match reply {
            Ok(Some(value)) => (STATUS_OK, value),
            Ok(None) => (STATUS_TIMEOUT, Vec::new()),
            Err(RequestError::Io) => return,
            Err(RequestError::Bad(msg)) => (STATUS_BAD_REQUEST, msg.into_bytes()),
        };
        if write_reply(&mut stream, status, &value).is_err() {
            return;
        }
    }
}

enum RequestError {
    /// The connection broke: drop it.
    Io,
    /// A malformed or impossible request: answer with the reason.
    Bad(String),
}

impl From<io::Error> for RequestError {
    fn from(_: io::Error) -> Self {
        RequestError::Io
    }
}

fn handle_request(
    op: u8,
    stream: &mut TcpStream,
    table: &Table,
) -> Result<Option<Vec<u8>>, RequestError> {
    let key = read_string(stream)?;
    match op {
        OP_SET => {
            let value = read_bytes(stream)?;
            table.set(key, value);
            Ok(Some(Vec::new()))
        }
        OP_GET => {
            let timeout = Duration::from_millis(read_u64(stream)?);
            Ok(table.wait_for(&key, timeout, |_| true))
        }
        OP_ADD => {
            let delta = read_u64(stream)? as i64;
            let value = table.add(key, delta).map_err(RequestError::Bad)?;
            Ok(Some(value.to_le_bytes().to_vec()))
        }
        OP_WAIT_AT_LEAST => {
            let target = read_u64(stream)? as i64;
            let timeout = Duration::from_millis(read_u64(stream)?);
            Ok(table.wait_for(&key, timeout, |v| {
                parse_counter(&key, v).is_ok_and(|c| c >= target)
            }))
        }
        // The rest of an unknown request cannot be skipped: drop the connection.
        _ => Err(RequestError::Io),
    }
}

/// A connection to the store.
#[derive(Debug)]
pub struct StoreClient {
    stream: Mutex<TcpStream>,
    /// Barriers entered so far per name: each use of a name is its own barrier.
    barriers: Mutex<HashMap<String, u64>>,
    addr: String,
    /// How long blocking requests wait.
    timeout: Duration,
}

impl StoreClient {
    /// Connects to `host:port`, retrying until the timeout passes (rank 0 may still be starting),
    /// and passes the handshake with `token`.
    pub fn connect(
        host: &str,
        port: u16,
        timeout: Duration,
        token: &JobToken,
    ) -> Result<Self, CommError> {
        let addr = format!("{host}:{port}");
        let deadline = Instant::now() + timeout;
        let targets: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| {
                CommError::Rendezvous(format!(
                    "cannot resolve the rendezvous address MASTER_ADDR={host} (port {port}): {e}"
                ))
            })?
            .collect();
        let mut last_error = String::from("no address to try");
        loop {
            for target in &targets {
                let left = deadline.saturating_duration_since(Instant::now());
                let attempt = left.clamp(Duration::from_millis(10), Duration::from_secs(2));
                match TcpStream::connect_timeout(target, attempt) {
                    Ok(mut stream) => {
                        connect_handshake(&mut stream, token, HANDSHAKE_TIMEOUT)
                            .map_err(|e| refused(&format!("the rendezvous store at {addr}"), e))?;
                        // Blocking requests wait at most `timeout` on the server: a reply that
                        // takes much longer means the store's host is gone.
                        let reply_limit = timeout.saturating_add(Duration::from_secs(30));
                        stream
                            .set_nodelay(true)
                            .and_then(|()| stream.set_read_timeout(Some(reply_limit)))
                            .map_err(|e| CommError::io("configuring the store connection", e))?;
                        return Ok(Self {
                            stream: Mutex::new(stream),
                            barriers: Mutex::default(),
                            addr,
                            timeout,
                        });
                    }
                    Err(e) => last_error = e.to_string(),
                }
            }
            if Instant::now() >= deadline {
                return Err(CommError::Rendezvous(format!(
                    "could not reach the rendezvous store at {addr} within {:.1} s (last error: \
                     {last_error}); check MASTER_ADDR/MASTER_PORT and that rank 0 is running",
                    timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The local address of the connection: the interface through which this host reaches the
    /// store, which is the one peers can reach it on too.
    pub fn local_ip(&self) -> Result<std::net::IpAddr, CommError> {
        self.lock()
            .local_addr()
            .map(|a| a.ip())
            .map_err(|e| CommError::io("reading the local address", e))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TcpStream> {
        self.stream.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn request(&self, op: u8, key: &str, fields: &[&[u8]]) -> Result<(u8, Vec<u8>), CommError> {
        let io_error = |e| CommError::Rendezvous(format!("store at {} failed: {e}", self.addr));
        let mut stream = self.lock();
        let mut frame = vec![op];
        push_bytes(&mut frame, key.as_bytes());
        for field in fields {
            frame.extend_from_slice(field);
        }
        stream.write_all(&frame).map_err(io_error)?;
        let status = read_u8(&mut *stream).map_err(io_error)?;
        let value = read_bytes(&mut *stream).map_err(io_error)?;
        if status == STATUS_BAD_REQUEST {
            return Err(CommError::Rendezvous(format!(
                "store at {} refused the request: {}",
                self.addr,
                String::from_utf8_lossy(&value)
            )));
        }
        Ok((status, value))
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        let mut field = Vec::new();
        push_bytes(&mut field, value);
        self.request(OP_SET, key, &[&field]).map(|_| ())
    }

    /// Waits until `key` is set and returns its value; `None` after the client's timeout.
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>, CommError> {
        self.get_within(key, self.timeout)
    }

    /// As [`get`](Self::get), waiting at most `timeout` (zero: look without waiting).
    pub fn get_within(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>, CommError> {
        let timeout = (timeout.as_millis() as u64).to_le_bytes();
        let (status, value) = self.request(OP_GET, key, &[&timeout])?;
        Ok((status == STATUS_OK).then_some(value))
    }

    /// Waits until every key in `keys` is set; names the ones still missing after the timeout.
    pub fn wait(&self, keys: &[&str]) -> Result<(), CommError> {
        let deadline = Instant::now() + self.timeout;
        let mut missing = Vec::new();
        for key in keys {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.get_within(key, left)?.is_none() {
                missing.push(*key);
            }
        }
        if missing.is_empty() {
            Ok(())
        } else {
            Err(CommError::Rendezvous(format!(
                "store keys {missing:?} were not set within {:.1} s",
                self.timeout.as_secs_f64()
            )))
        }
    }

    /// Adds `delta` to the counter at `key` (0 when unset) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, CommError> {
        let (_, value) = self.request(OP_ADD, key, &[&delta.to_le_bytes()])?;
        let bytes: [u8; 8] = value.as_slice().try_into().map_err(|_| {
            CommError::Rendezvous(format!("store at {} sent a malformed counter", self.addr))
        })?;
        Ok(i64::from_le_bytes(bytes))
    }

    /// Waits until the counter at `key` reaches `target`; false after the client's timeout.
    pub fn wait_at_least(&self, key: &str, target: i64) -> Result<bool, CommError> {
        let timeout = self.timeout_ms();
        let (status, _) =
            self.request(OP_WAIT_AT_LEAST, key, &[&target.to_le_bytes(), &timeout])?;
        Ok(status == STATUS_OK)
    }

    /// Blocks until `count` clients have entered the barrier called `name`. A name can be used
    /// again: the n-th call on every client meets the n-th call on the others.
    pub fn barrier(&self, name: &str, count: usize) -> Result<(), CommError> {
        let generation = {
            let mut barriers = self.barriers.lock().unwrap_or_else(|e| e.into_inner());
            let entry = barriers.entry(name.to_string()).or_insert(0);
            *entry += 1;
            *entry
        };
        let key = format!("barrier/{name}/{generation}");
        let arrived = self.add(&key, 1)?;
        if !self.wait_at_least(&key, count as i64)? {
            return Err(CommError::Rendezvous(format!(
                "store barrier {name:?} timed out after {:.1} s with {arrived} of {count} ranks \
                 arrived",
                self.timeout.as_secs_f64()
            )));
        }
        Ok(())
    }

    fn timeout_ms(&self) -> [u8; 8] {
        (self.timeout.as_millis() as u64).to_le_bytes()
    }
}

impl Drop for StoreClient {
    fn drop(&mut self) {
        let _ = self.lock().shutdown(Shutdown::Both);
    }
}

fn push_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn write_reply(stream: &mut TcpStream, status: u8, value: &[u8]) -> io::Result<()> {
    let mut frame = vec![status];
    push_bytes(&mut frame, value);
    stream.write_all(&frame)
}

fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// Keys and values are small (addresses, counters, ids): anything larger is not a wildfire client.
const MAX_FIELD: usize = 1 << 20;

fn read_bytes(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FIELD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("store field of {len} bytes"),
        ));
    }
    let mut value = vec![0u8; len];
    r.read_exact(&mut value)?;
    Ok(value)
}

fn read_string(r: &mut impl Read) -> io::Result<String> {
    String::from_utf8(read_bytes(r)?).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOOPBACK: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    #[test]
    fn set_get_add_wait_and_barrier() {
        let server = StoreServer::start(LOOPBACK, 0, JobToken::default()).expect("start");
        let port = server.local_addr().port();
        let timeout = Duration::from_secs(5);
        let a = StoreClient::connect("127.0.0.1", port, timeout, &JobToken::default())
            .expect("connect");
        let b = StoreClient::connect("127.0.0.1", port, timeout, &JobToken::default())
            .expect("connect");
        let waiter = std::thread::spawn(move || {
            b.wait(&["k", "k2"]).expect("wait");
            b.get("k").expect("get")
        });
        std::thread::sleep(Duration::from_millis(50));
        a.set("k", b"v").expect("set");
        a.set("k2", b"w").expect("set");
        assert_eq!(waiter.join().expect("join"), Some(b"v".to_vec()));
        assert_eq!(a.add("c", 2).expect("add"), 2);
        assert_eq!(a.add("c", 3).expect("add"), 5);
        assert!(a.wait_at_least("c", 5).expect("wait"));
        let clients: Vec<_> = (0..3)
            .map(|_| {
                StoreClient::connect("127.0.0.1", port, timeout, &JobToken::default())
                    .expect("connect")
            })
            .collect();
        let handles: Vec<_> = clients
            .into_iter()
            .map(|c| std::thread::spawn(move || c.barrier("b", 3).and_then(|()| c.barrier("b", 3))))
            .collect();
        for h in handles {
            h.join().expect("join").expect("barrier");
        }
    }

    #[test]
    fn get_times_out_and_counter_misuse_is_an_error() {
        let server = StoreServer::start(LOOPBACK, 0, JobToken::default()).expect("start");
        let port = server.local_addr().port();
        let c = StoreClient::connect(
            "127.0.0.1",
            port,
            Duration::from_millis(100),
            &JobToken::default(),
        )
        .expect("c");
        assert_eq!(c.get("never").expect("get"), None);
        let err = c.wait(&["never", "nor-this"]).expect_err("unset keys");
        assert!(
            err.to_string().contains("[\"never\", \"nor-this\"]"),
            "{err}"
        );
        c.set("text", b"abc").expect("set");
        let err = c.add("text", 1).expect_err("not a counter");
        assert!(err.to_string().contains("does not hold a counter"), "{err}");
    }

    #[test]
    fn port_in_use_and_unreachable_store_name_the_address() {
        let taken = TcpListener::bind(("0.0.0.0", 0)).expect("bind");
        let port = taken.local_addr().expect("addr").port();
        let err = StoreServer::start(IpAddr::from([0, 0, 0, 0]), port, JobToken::default())
            .expect_err("in use");
        assert!(
            err.to_string()
                .contains(&format!("port {port} is already in use")),
            "{err}"
        );

        let free = TcpListener::bind(("127.0.0.1", 0)).expect("bind");
        let port = free.local_addr().expect("addr").port();
        drop(free);
        let start = Instant::now();
        let err = StoreClient::connect(
            "127.0.0.1",
            port,
            Duration::from_millis(300),
            &JobToken::default(),
        )
        .expect_err("nobody listens");
        assert!(start.elapsed() < Duration::from_secs(3));
        assert!(
            err.to_string().contains(&format!("127.0.0.1:{port}")),
            "{err}"
        );
        let err = StoreClient::connect(
            "no-such-host.invalid",
            1,
            Duration::from_millis(100),
            &JobToken::default(),
        )
        .expect_err("unresolvable");
        assert!(err.to_string().contains("no-such-host.invalid"), "{err}");
        // 192.0.2.1 (TEST-NET-1) is no address of this host.
        let err = StoreServer::start(IpAddr::from([192, 0, 2, 1]), 0, JobToken::default())
            .expect_err("not local");
        assert!(
            err.to_string().contains("not an address of this host"),
            "{err}"
        );
    }

    #[test]
    fn clients_without_the_secret_garbage_and_idle_ones_do_not_stop_the_store() {
        let secret = JobToken::new("the job's secret");
        let server = StoreServer::start(LOOPBACK, 0, secret.clone()).expect("start");
        let port = server.local_addr().port();
        let timeout = Duration::from_secs(5);
        let idle = TcpStream::connect(("127.0.0.1", port)).expect("idle");
        let mut garbage = TcpStream::connect(("127.0.0.1", port)).expect("garbage");
        garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").expect("write");
        for wrong in [JobToken::new("a guess"), JobToken::default()] {
            let err =
                StoreClient::connect("127.0.0.1", port, timeout, &wrong).expect_err("refused");
            assert!(
                err.to_string().contains("refused this rank's handshake"),
                "{err}"
            );
        }
        let good = StoreClient::connect("127.0.0.1", port, timeout, &secret).expect("connect");
        good.set("k", b"v").expect("set");
        assert_eq!(good.get("k").expect("get").as_deref(), Some(&b"v"[..]));
        drop((idle, garbage));
    }
}
