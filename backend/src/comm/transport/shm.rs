//! The `shm` transport: processes of one host exchange messages through shared memory.
//!
//! Every rank creates one segment (POSIX shared memory, a random name, mode 0600) holding a ring
//! per peer: ring q carries rank q's frames (`transport::frame`'s format) to this rank. Ranks
//! exchange the names through the store and map each other's segments; once every rank has
//! mapped every peer's segment, each creator unlinks its own, so nothing stays in /dev/shm
//! whatever happens to the job afterwards (the mappings keep the memory until the last rank
//! exits). A crash during that exchange can leave a segment behind: the next start on the host
//! removes segments whose creator is gone (older than a minute, so never one being created).
//!
//! A rank holds an exclusive `flock` on its segment for as long as it lives. A peer that can take
//! that lock knows the rank is gone (exit, crash or SIGKILL alike): that is how receives and
//! sends stop waiting for a dead rank, whatever the pid namespaces.
//!
//! A ring has one producer (the sending rank, one send at a time) and one consumer (this rank's
//! reader thread for that peer). `head` counts the bytes written, `tail` the bytes read; each
//! side publishes its counter with release ordering, bumps a shared counter, and wakes the other
//! side's futex on it when that side sleeps. The writer publishes every [`COMMIT_BYTES`], so a large frame streams: the
//! reader copies out while the writer copies in. Sends return once their bytes are in the ring;
//! the reader thread decodes frames into the mailbox as the tcp transport's does.

use std::ffi::CString;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Transport;
use super::frame::{frame_head, read_head, read_payload};
use crate::comm::auth::random_hex;
use crate::comm::error::CommError;
use crate::comm::mailbox::{Mailbox, Message};
use crate::comm::store::StoreClient;

/// Environment variable: `tcp`, `shm`, or `auto` (the default: `shm` when every rank is on this
/// host and its shared memory works, else `tcp`).
pub const TRANSPORT_ENV: &str = "WILDFIRE_TRANSPORT";
/// Environment variable: bytes of each ring (default [`DEFAULT_RING_BYTES`]).
pub const RING_BYTES_ENV: &str = "WILDFIRE_SHM_RING_BYTES";
/// 4 MiB per pair of ranks: four pieces in flight.
const DEFAULT_RING_BYTES: usize = 4 << 20;
/// Large transfers are cut into pieces of this size (see [`Transport::piece_bytes`]).
const PIECE_BYTES: usize = 1 << 20;
/// The writer publishes its progress at least this often.
const COMMIT_BYTES: usize = 256 << 10;
/// How often a waiting side checks that the other side still lives.
const LIVENESS_POLL: Duration = Duration::from_millis(20);
/// Spins before sleeping on the futex (short: with two cores, spinning steals the peer's).
const SPINS: usize = 64;
const SHM_DIR: &str = "/dev/shm";
const NAME_PREFIX: &str = "wildfire-";

/// Which transport the ranks of one host use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Choice {
    Tcp,
    Shm,
    Auto,
}

impl Choice {
    pub(crate) fn from_env() -> Result<Self, CommError> {
        match std::env::var(TRANSPORT_ENV).as_deref() {
            Err(_) | Ok("") | Ok("auto") => Ok(Choice::Auto),
            Ok("tcp") => Ok(Choice::Tcp),
            Ok("shm") => Ok(Choice::Shm),
            Ok(other) => Err(CommError::Rendezvous(format!(
                "{TRANSPORT_ENV}={other:?} is not one of tcp, shm, auto"
            ))),
        }
    }
}

/// The control block of one ring, each counter on its own cache line.
#[repr(C)]
struct RingControl {
    head: Padded<AtomicU64>,
    tail: Padded<AtomicU64>,
    /// Bumped after `head` moves (the reader's futex).
    written: Padded<AtomicU32>,
    /// Bumped after `tail` moves (the writer's futex).
    read: Padded<AtomicU32>,
    /// Set while the reader sleeps on `written` (so the writer wakes it).
    reader_sleeps: Padded<AtomicU32>,
    /// Set while the writer sleeps on `read`.
    writer_sleeps: Padded<AtomicU32>,
}

#[repr(C, align(64))]
struct Padded<T>(T);

/// A mapped segment: the rings into its creator.
struct Segment {
    base: *mut u8,
    len: usize,
    rings: usize,
    ring_bytes: usize,
    /// Open for as long as the mapping: the creator's exclusive lock lives on it.
    fd: OwnedFd,
}

// SAFETY: the mapping is shared memory accessed through atomics and ring discipline only.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

fn control_bytes(rings: usize) -> usize {
    (rings * size_of::<RingControl>()).next_multiple_of(4096)
}

fn os_error(what: impl std::fmt::Display) -> String {
    format!("{what}: {}", io::Error::last_os_error())
}

impl Segment {
    fn size(rings: usize, ring_bytes: usize) -> usize {
        control_bytes(rings) + rings * ring_bytes
    }

    /// Creates `name` (mode 0600, failing if it exists), locks it, reserves its memory and maps
    /// it. Fails with the reason when /dev/shm lacks room.
    fn create(name: &str, rings: usize, ring_bytes: usize) -> Result<Self, String> {
        let len = Self::size(rings, ring_bytes);
        let free = shm_free_bytes()?;
        if len > free {
            return Err(format!(
                "{SHM_DIR} has {free} bytes free and this rank's {rings} ring(s) of {ring_bytes} \
                 bytes need {len} (enlarge it, e.g. docker run --shm-size, or set \
                 {RING_BYTES_ENV} lower)"
            ));
        }
        let c_name = shm_name(name)?;
        // SAFETY: a valid C string; the returned descriptor is owned below.
        let fd = unsafe {
            libc::shm_open(
                c_name.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        if fd < 0 {
            return Err(os_error(format!("creating {SHM_DIR}/{name}")));
        }
        // SAFETY: `fd` was just opened and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let reserved = (|| {
            // SAFETY: plain calls on an open descriptor.
            if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                return Err(os_error("locking it"));
            }
            let code = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, len as libc::off_t) };
            if code != 0 {
                return Err(format!(
                    "reserving {len} bytes of {SHM_DIR}: {}",
                    io::Error::from_raw_os_error(code)
                ));
            }
            Self::map(fd, len, rings, ring_bytes)
        })();
        if reserved.is_err() {
            unlink(name);
        }
        reserved
    }

    /// Opens and maps a peer's segment, checking its size.
    fn open(name: &str, rings: usize, ring_bytes: usize) -> Result<Self, String> {
        let c_name = shm_name(name)?;
        // SAFETY: a valid C string; the returned descriptor is owned below.
        let fd = unsafe { libc::shm_open(c_name.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            return Err(os_error(format!("opening {SHM_DIR}/{name}")));
        }
        // SAFETY: `fd` was just opened and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let len = Self::size(rings, ring_bytes);
        // SAFETY: `stat` is plain data, filled by fstat.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) } != 0 || stat.st_size as usize != len {
            return Err(format!(
                "{SHM_DIR}/{name} is not a segment of {len} bytes (another ring size?)"
            ));
        }
        Self::map(fd, len, rings, ring_bytes)
    }

    fn map(fd: OwnedFd, len: usize, rings: usize, ring_bytes: usize) -> Result<Self, String> {
        // SAFETY: maps `len` bytes of an open descriptor of that size.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(os_error(format!("mapping {len} bytes")));
        }
        Ok(Self {
            base: base.cast(),
            len,
            rings,
            ring_bytes,
            fd,
        })
    }

    /// Ring `slot`: its control block and its data.
    fn ring(&self, slot: usize) -> Ring<'_> {
        assert!(slot < self.rings, "ring {slot} of {}", self.rings);
        // SAFETY: both lie inside the mapping; the control blocks are 64-byte aligned (the
        // mapping is page-aligned) and zero-initialised, a valid state of its atomics.
        unsafe {
            let control = &*self.base.cast::<RingControl>().add(slot);
            let data = self
                .base
                .add(control_bytes(self.rings) + slot * self.ring_bytes);
            Ring {
                control,
                data,
                capacity: self.ring_bytes as u64,
            }
        }
    }

    /// Whether the creator still holds its lock (lives). Only for a segment this process
    /// opened, not one it created.
    fn creator_lives(&self) -> bool {
        // SAFETY: plain calls on an open descriptor.
        let got = unsafe { libc::flock(self.fd.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
        if got == 0 {
            unsafe { libc::flock(self.fd.as_raw_fd(), libc::LOCK_UN) };
        }
        got != 0
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn shm_free_bytes() -> Result<usize, String> {
    let dir = CString::new(SHM_DIR).expect("no NUL");
    // SAFETY: `stat` is plain data, filled by statvfs.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(dir.as_ptr(), &mut stat) } != 0 {
        return Err(os_error(format!("reading the size of {SHM_DIR}")));
    }
    Ok((stat.f_bavail as usize).saturating_mul(stat.f_frsize as usize))
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a shared (not process-private) futex wait on a live atomic, with a timeout.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: wakes the waiters of a live atomic in shared memory.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// Tells the other side that its counter moved: bumps `signal`, and wakes the other side only if
/// it sleeps (a system call saved on most calls).
fn notify(signal: &AtomicU32, sleeps: &AtomicU32) {
    signal.fetch_add(1, Ordering::SeqCst);
    if sleeps.load(Ordering::SeqCst) != 0 {
        futex_wake(signal);
    }
}

/// Waits until `ready` gives a value: spins briefly, then sleeps on `signal` with `sleeps` set.
/// No wake-up is lost: a bump after `seen` was read makes the futex return at once, and one
/// before it is visible to `ready`. Every [`LIVENESS_POLL`] asks `gone` whether to give up.
fn wait_on<T>(
    signal: &AtomicU32,
    sleeps: &AtomicU32,
    mut ready: impl FnMut() -> Option<T>,
    mut gone: impl FnMut() -> Option<String>,
) -> Result<T, String> {
    let (mut spins, mut checked) = (0, Instant::now());
    loop {
        let seen = signal.load(Ordering::Acquire);
        if let Some(value) = ready() {
            return Ok(value);
        }
        if spins < SPINS {
            spins += 1;
            std::hint::spin_loop();
            continue;
        }
        sleeps.store(1, Ordering::SeqCst);
        futex_wait(signal, seen, LIVENESS_POLL);
        sleeps.store(0, Ordering::SeqCst);
        if checked.elapsed() >= LIVENESS_POLL {
            if let Some(why) = gone() {
                // The other side may have finished its last bytes before it went.
                return ready().ok_or(why);
            }
            checked = Instant::now();
        }
    }
}

/// One ring in a mapped segment.
struct Ring<'a> {
    control: &'a RingControl,
    data: *mut u8,
    capacity: u64,
}

impl Ring<'_> {
    /// Copies `len` bytes between the ring at byte position `at` and `outside`, in up to two
    /// runs (the ring wraps). `into_ring` says which way.
    ///
    /// # Safety
    /// `outside` is valid for `len` bytes, and the ring's `[at, at + len)` is this side's to
    /// touch (free space for the writer, published bytes for the reader).
    unsafe fn copy(&self, at: u64, outside: *mut u8, len: usize, into_ring: bool) {
        let start = (at % self.capacity) as usize;
        let first = len.min(self.capacity as usize - start);
        for (ring_at, out_at, n) in [(start, 0, first), (0, first, len - first)] {
            if n == 0 {
                continue;
            }
            // SAFETY: the caller's contract, with `ring_at + n <= capacity`.
            unsafe {
                let (ring, out) = (self.data.add(ring_at), outside.add(out_at));
                match into_ring {
                    true => std::ptr::copy_nonoverlapping(out, ring, n),
                    false => std::ptr::copy_nonoverlapping(ring, out, n),
                }
            }
        }
    }

    /// Writes all of `bytes`, waiting for room; `gone` says whether the reader is gone.
    fn write_all(
        &self,
        mut bytes: &[u8],
        gone: &mut impl FnMut() -> Option<String>,
    ) -> Result<(), String> {
        let c = self.control;
        while !bytes.is_empty() {
            let head = c.head.0.load(Ordering::Relaxed);
            let free = wait_on(
                &c.read.0,
                &c.writer_sleeps.0,
                || {
                    let used = head - c.tail.0.load(Ordering::Acquire);
                    (used < self.capacity).then_some(self.capacity - used)
                },
                &mut *gone,
            )?;
            let n = bytes.len().min(free as usize).min(COMMIT_BYTES);
            // SAFETY: `[head, head + n)` is free space, and `bytes` holds `n` bytes.
            unsafe { self.copy(head, bytes.as_ptr().cast_mut(), n, true) };
            c.head.0.store(head + n as u64, Ordering::Release);
            notify(&c.written.0, &c.reader_sleeps.0);
            bytes = &bytes[n..];
        }
        Ok(())
    }
}

/// The reading side of one ring, as a byte stream that ends when the writer is gone or this
/// rank closes.
struct RingReader<'a> {
    ring: Ring<'a>,
    writer: &'a Segment,
    peer: usize,
    closing: &'a AtomicBool,
}

impl RingReader<'_> {
    /// Copies between 1 and `len` bytes to `dst`, waiting for the first one.
    fn take(&mut self, dst: *mut u8, len: usize) -> io::Result<usize> {
        let c = self.ring.control;
        let tail = c.tail.0.load(Ordering::Relaxed);
        let (writer, peer, closing) = (self.writer, self.peer, self.closing);
        let available = wait_on(
            &c.written.0,
            &c.reader_sleeps.0,
            || {
                let head = c.head.0.load(Ordering::Acquire);
                (head > tail).then_some(head - tail)
            },
            || {
                if closing.load(Ordering::Relaxed) {
                    Some("this rank closed its transport".into())
                } else if !writer.creator_lives() {
                    Some(format!("rank {peer} exited (process gone)"))
                } else {
                    None
                }
            },
        )
        .map_err(|why| io::Error::new(io::ErrorKind::UnexpectedEof, why))?;
        let n = len.min(available as usize);
        // SAFETY: `[tail, tail + n)` was published by the writer; `dst` holds `len >= n` bytes.
        unsafe { self.ring.copy(tail, dst, n, false) };
        c.tail.0.store(tail + n as u64, Ordering::Release);
        notify(&c.read.0, &c.writer_sleeps.0);
        Ok(n)
    }

    fn fill(&mut self, dst: *mut u8, len: usize) -> io::Result<()> {
        let mut filled = 0;
        while filled < len {
            // SAFETY: `dst` holds `len` bytes.
            filled += self.take(unsafe { dst.add(filled) }, len - filled)?;
        }
        Ok(())
    }

    fn read_message(&mut self) -> io::Result<Message> {
        let head = read_head(self)?;
        read_payload(head, |dst, len| self.fill(dst, len))
    }
}

impl Read for RingReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        self.take(buf.as_mut_ptr(), buf.len())
    }
}

pub(crate) struct ShmTransport {
    rank: usize,
    world_size: usize,
    /// Peer q's segment (where this rank writes), `None` for this rank.
    peers: Vec<Option<Arc<Segment>>>,
    /// One send at a time per ring.
    writing: Vec<Mutex<()>>,
    mailbox: Arc<Mailbox>,
    closing: Arc<AtomicBool>,
    readers: Vec<JoinHandle<()>>,
    /// This rank's segment (the rings into it); holds the lock peers watch.
    _own: Arc<Segment>,
}

/// The ring of `from` in `to`'s segment: every rank but `to`, in order.
fn slot(from: usize, to: usize) -> usize {
    if from < to { from } else { from - 1 }
}

fn shm_key(round: &str, rank: usize) -> String {
    format!("wildfire/shm/{round}/{rank}")
}

/// This host, as far as shared memory goes: its name and its boot.
fn host_id() -> String {
    let read = |path| std::fs::read_to_string(path).unwrap_or_default();
    format!(
        "{}/{}",
        read("/proc/sys/kernel/hostname").trim(),
        read("/proc/sys/kernel/random/boot_id").trim()
    )
}

fn ring_bytes() -> Result<usize, CommError> {
    match std::env::var(RING_BYTES_ENV) {
        Err(_) => Ok(DEFAULT_RING_BYTES),
        Ok(value) => value
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|n| *n >= 4096)
            .ok_or_else(|| {
                CommError::Rendezvous(format!(
                    "{RING_BYTES_ENV}={value:?} is not a number of bytes of at least 4096"
                ))
            }),
    }
}

/// Publishes this rank's verdict for `round` (`Ok(detail)` or `Err(why)`) and reads every
/// rank's; returns the details, or the first rank's reason against.
fn agree(
    store: &StoreClient,
    round: &str,
    rank: usize,
    world_size: usize,
    mine: Result<String, String>,
) -> Result<Result<Vec<String>, String>, CommError> {
    let value = match &mine {
        Ok(detail) => format!("ok {detail}"),
        Err(why) => format!("no {why}"),
    };
    store.set(&shm_key(round, rank), value.as_bytes())?;
    let mut details = Vec::with_capacity(world_size);
    for r in 0..world_size {
        let value = store.get(&shm_key(round, r))?.ok_or_else(|| {
            CommError::Rendezvous(format!(
                "rank {r} never said whether it can use shared memory"
            ))
        })?;
        let value = String::from_utf8_lossy(&value).into_owned();
        match value.split_once(' ') {
            Some(("ok", detail)) => details.push(detail.to_string()),
            Some((_, why)) => return Ok(Err(format!("rank {r}: {why}"))),
            None => return Ok(Err(format!("rank {r}: {value}"))),
        }
    }
    Ok(Ok(details))
}

impl ShmTransport {
    /// Connects every rank of the job through shared memory, or none: `Ok(Err(why))`, the same
    /// on every rank, when some rank cannot (`wanted` is this rank's say: the job spans hosts,
    /// `WILDFIRE_TRANSPORT=tcp`, ...; or no /dev/shm, too little room, another host). `job` tags
    /// segment names.
    pub(crate) fn connect(
        rank: usize,
        world_size: usize,
        store: &StoreClient,
        wanted: Result<(), String>,
        job: &str,
    ) -> Result<Result<Self, String>, CommError> {
        let ring_bytes = ring_bytes()?;
        let rings = world_size - 1;
        let host = host_id();
        let own = wanted.and_then(|()| create_own(job, rank, rings, ring_bytes));
        let mine = match &own {
            Ok((name, _)) => Ok(format!("{host} {name}")),
            Err(why) => Err(why.clone()),
        };
        let connected = agree(store, "created", rank, world_size, mine).and_then(|names| {
            let names = match names {
                Ok(names) => names,
                Err(why) => return Ok(Err(why)),
            };
            let peers = open_peers(&names, &host, rank, rings, ring_bytes);
            let mine = peers.as_ref().map(|_| String::new()).map_err(Clone::clone);
            Ok(agree(store, "mapped", rank, world_size, mine)?.and(peers))
        });
        // Every rank has opened it, or none will: either way its name can go.
        let own = own.map(|(name, segment)| {
            unlink(&name);
            Arc::new(segment)
        });
        Ok(match (connected?, own) {
            (Ok(peers), Ok(own)) => Ok(Self::start(rank, world_size, own, peers)),
            (Err(why), _) | (_, Err(why)) => Err(why),
        })
    }

    fn start(
        rank: usize,
        world_size: usize,
        own: Arc<Segment>,
        peers: Vec<Option<Arc<Segment>>>,
    ) -> Self {
        let mailbox = Arc::new(Mailbox::default());
        let closing = Arc::new(AtomicBool::new(false));
        let readers = (0..world_size)
            .filter(|q| *q != rank)
            .map(|q| {
                let (own, writer) = (own.clone(), peers[q].clone().expect("a peer's segment"));
                let (mailbox, closing) = (mailbox.clone(), closing.clone());
                std::thread::Builder::new()
                    .name(format!("wildfire-shm-{q}"))
                    .spawn(move || {
                        let mut reader = RingReader {
                            ring: own.ring(slot(q, rank)),
                            writer: &writer,
                            peer: q,
                            closing: &closing,
                        };
                        read_loop(&mut reader, &mailbox);
                    })
                    .expect("starting a reader thread")
            })
            .collect();
        Self {
            rank,
            world_size,
            peers,
            writing: (0..world_size).map(|_| Mutex::new(())).collect(),
            mailbox,
            closing,
            readers,
            _own: own,
        }
    }
}

/// Opens every peer's segment from its "host name" detail; fails on a peer of another host
/// than `host`.
fn open_peers(
    details: &[String],
    host: &str,
    rank: usize,
    rings: usize,
    ring_bytes: usize,
) -> Result<Vec<Option<Arc<Segment>>>, String> {
    let open = |(q, detail): (usize, &String)| {
        let (their_host, name) = detail.rsplit_once(' ').unwrap_or(("", detail));
        if q == rank {
            Ok(None)
        } else if their_host != host {
            Err(format!("rank {q} is on another host"))
        } else {
            Segment::open(name, rings, ring_bytes).map(|s| Some(Arc::new(s)))
        }
    };
    details.iter().enumerate().map(open).collect()
}

fn read_loop(reader: &mut RingReader<'_>, mailbox: &Mailbox) {
    loop {
        match reader.read_message() {
            Ok(message) => mailbox.deliver(reader.peer, message),
            Err(e) => {
                if !reader.closing.load(Ordering::Relaxed) {
                    mailbox.mark_lost(reader.peer, e.to_string());
                }
                return;
            }
        }
    }
}

/// Creates this rank's segment after removing stale ones; returns its name.
fn create_own(
    job: &str,
    rank: usize,
    rings: usize,
    ring_bytes: usize,
) -> Result<(String, Segment), String> {
    remove_stale_segments(STALE_AFTER);
    let hex = random_hex::<16>().map_err(|e| format!("reading random bytes: {e}"))?;
    let name = format!("{NAME_PREFIX}{job}-r{rank}-{hex}");
    Segment::create(&name, rings, ring_bytes).map(|segment| (name, segment))
}

/// The name `shm_open` and `shm_unlink` take for /dev/shm/`name`.
fn shm_name(name: &str) -> Result<CString, String> {
    CString::new(format!("/{name}")).map_err(|e| e.to_string())
}

fn unlink(name: &str) {
    if let Ok(c_name) = shm_name(name) {
        // SAFETY: a valid C string.
        unsafe { libc::shm_unlink(c_name.as_ptr()) };
    }
}

/// Segments younger than this are left alone by the sweep: their creator may not have locked
/// them yet.
const STALE_AFTER: Duration = Duration::from_secs(60);

/// Removes this user's segments older than `min_age` whose creator is gone (its lock is free):
/// leftovers of a rank that died between creating its segment and unlinking it.
fn remove_stale_segments(min_age: Duration) {
    let Ok(entries) = std::fs::read_dir(SHM_DIR) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let age = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok());
        if !name.starts_with(NAME_PREFIX) || age.is_none_or(|age| age < min_age) {
            continue;
        }
        let Ok(file) = std::fs::OpenOptions::new().read(true).open(entry.path()) else {
            continue;
        };
        // SAFETY: plain calls on an open descriptor.
        let (owner, free) = unsafe {
            let mut stat: libc::stat = std::mem::zeroed();
            let owner = (libc::fstat(file.as_raw_fd(), &mut stat) == 0).then_some(stat.st_uid);
            let free = libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0;
            (owner, free)
        };
        if free && owner == Some(unsafe { libc::geteuid() }) {
            unlink(&name);
        }
    }
}

impl Transport for ShmTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn name(&self) -> &'static str {
        "shm"
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
        let segment = self.peers[dst]
            .as_ref()
            .ok_or_else(|| format!("no ring to rank {dst}"))?;
        let ring = segment.ring(slot(self.rank, dst));
        let mut gone =
            || (!segment.creator_lives()).then(|| format!("rank {dst} exited (process gone)"));
        let _one_at_a_time = self.writing[dst].lock().unwrap_or_else(|e| e.into_inner());
        let written = ring
            .write_all(&frame_head(&message), &mut gone)
            .and_then(|()| ring.write_all(message.payload.bytes(), &mut gone));
        if let Err(reason) = &written {
            self.mailbox.mark_lost(dst, reason.clone());
        }
        written
    }
    fn mailbox(&self) -> &Mailbox {
        &self.mailbox
    }
}

impl Drop for ShmTransport {
    /// Stops the reader threads (each notices within [`LIVENESS_POLL`]); sent bytes stay
    /// readable in the peers' segments.
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Relaxed);
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_skip_the_receiver() {
        assert_eq!(
            (0..4)
                .filter(|q| *q != 2)
                .map(|q| slot(q, 2))
                .collect::<Vec<_>>(),
            [0, 1, 2]
        );
        assert_eq!(slot(1, 0), 0);
    }

    #[test]
    fn a_segment_left_by_a_dead_creator_is_removed_and_a_live_ones_is_not() {
        let tag = format!("test{}", std::process::id());
        let (live, _segment) = create_own(&tag, 0, 1, 4096).unwrap();
        let stale = format!("{NAME_PREFIX}{tag}-stale");
        std::fs::write(format!("{SHM_DIR}/{stale}"), b"left behind").unwrap();
        remove_stale_segments(STALE_AFTER);
        assert!(
            std::path::Path::new(&format!("{SHM_DIR}/{stale}")).exists(),
            "a young segment may not be locked yet: it stays"
        );
        remove_stale_segments(Duration::ZERO);
        assert!(!std::path::Path::new(&format!("{SHM_DIR}/{stale}")).exists());
        assert!(std::path::Path::new(&format!("{SHM_DIR}/{live}")).exists());
        unlink(&live);
    }

    #[test]
    fn too_little_room_is_refused_with_the_sizes() {
        let tag = format!("big{}", std::process::id());
        let error = create_own(&tag, 0, 2, 1 << 50).map(drop).unwrap_err();
        assert!(
            error.contains("bytes free") && error.contains(RING_BYTES_ENV),
            "{error}"
        );
    }
}
