//! [`ProcessGroup`]: a cheap handle on a set of ranks, the unit every collective runs over.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::buffer::Payload;
use super::element::WireDType;
use super::error::CommError;
use super::mailbox::{Channel, Descriptor, Key, Message, OpKind, RecvFailure};
use super::transport::Transport;
use super::transport::local::LocalTransport;

/// Environment variable: the deadline of every blocking call, in seconds.
pub const TIMEOUT_ENV: &str = "WILDFIRE_COMM_TIMEOUT";
/// Environment variable: `1` checks before each collective that all ranks agree on it.
pub const DEBUG_ENV: &str = "WILDFIRE_COMM_DEBUG";

/// Settings shared by a world and its sub-groups.
#[derive(Debug, Clone, PartialEq)]
pub struct CommOptions {
    /// How long any blocking call waits for its peers before failing with a timeout.
    pub timeout: Duration,
    /// Before each collective, all ranks exchange (op, sequence number, dtype, shape) and fail
    /// naming the first rank that disagrees. Costs one small message per peer per collective.
    pub debug: bool,
}

impl Default for CommOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            debug: false,
        }
    }
}

impl CommOptions {
    /// Defaults, overridden by `WILDFIRE_COMM_TIMEOUT` and `WILDFIRE_COMM_DEBUG`.
    pub fn from_env() -> Result<Self, CommError> {
        let mut options = Self::default();
        if let Ok(value) = std::env::var(TIMEOUT_ENV) {
            options.timeout = parse_timeout(&value).ok_or_else(|| {
                CommError::Rendezvous(format!(
                    "{TIMEOUT_ENV}={value:?} is not a number of seconds between 0 and one year"
                ))
            })?;
        }
        if let Ok(value) = std::env::var(DEBUG_ENV) {
            options.debug = match value.trim() {
                "1" | "true" | "yes" | "on" => true,
                "0" | "false" | "no" | "off" | "" => false,
                _ => {
                    return Err(CommError::Rendezvous(format!(
                        "{DEBUG_ENV}={value:?} is not one of 1, 0, true, false"
                    )));
                }
            };
        }
        Ok(options)
    }
}

/// The longest deadline accepted: a year (longer ones would overflow `Instant` arithmetic).
const MAX_TIMEOUT_SECS: f64 = 365.0 * 24.0 * 3600.0;

/// Parses a positive number of seconds, at most a year ("300", "2.5").
pub fn parse_timeout(value: &str) -> Option<Duration> {
    timeout_from_secs(value.trim().parse().ok()?)
}

/// A deadline of `secs` seconds, if positive and at most a year.
pub fn timeout_from_secs(secs: f64) -> Option<Duration> {
    (secs > 0.0 && secs <= MAX_TIMEOUT_SECS).then(|| Duration::from_secs_f64(secs))
}

pub(crate) struct GroupInner {
    pub(crate) id: u64,
    /// Global ranks, in group-rank order.
    pub(crate) ranks: Vec<usize>,
    /// This rank's index in `ranks`.
    pub(crate) me: usize,
    seq: AtomicU64,
    /// Collectives issued so far, per op (index: `OpKind as usize`).
    counts: [AtomicU64; OpKind::ALL.len()],
    /// Nanoseconds this rank has spent inside them, from start to return.
    busy_ns: AtomicU64,
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) options: CommOptions,
    /// Sub-groups created so far per rank list, world-wide, so that creating the same rank list
    /// twice gives two groups with distinct ids (members create groups in the same order).
    created: Arc<Mutex<HashMap<Vec<usize>, u64>>>,
    /// The rendezvous store of a multi-process world (served by rank 0), kept as long as the
    /// world; NCCL communicators agree on their unique id through it.
    pub(crate) rendezvous: Option<Arc<Rendezvous>>,
    /// This group's NCCL communicator, created by its first collective on CUDA tensors; a
    /// failed creation is kept as its error and not retried (a retry could pair ranks with
    /// different unique ids).
    #[cfg(feature = "cuda")]
    pub(crate) nccl: Mutex<Option<Result<super::nccl_device::NcclComm, String>>>,
}

/// A multi-process world's rendezvous store: the client of every rank, and the server on rank 0.
pub(crate) struct Rendezvous {
    /// Read by NCCL setup only (feature `cuda`); without it, the client is just kept alive.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) store: super::store::StoreClient,
    pub(crate) _server: Option<super::store::StoreServer>,
}

/// A set of ranks that run collectives together.
///
/// Cloning is cheap and clones share the group's sequence counter: collectives of one group must
/// be issued in the same order on every member, from one thread at a time, as in torch.distributed.
#[derive(Clone)]
pub struct ProcessGroup {
    pub(crate) inner: Arc<GroupInner>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ProcessGroup({}, rank {})", self.describe(), self.rank())
    }
}

/// FNV-1a (64 bits) of `bytes`: a stable checksum, the same in every process.
pub fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// FNV-1a of `parts`' little-endian bytes.
fn fnv1a_words(parts: &[u64]) -> u64 {
    fnv1a(parts.iter().flat_map(|part| part.to_le_bytes()))
}

impl ProcessGroup {
    pub(crate) fn world(
        transport: Arc<dyn Transport>,
        options: CommOptions,
        rendezvous: Option<Arc<Rendezvous>>,
    ) -> Self {
        let world_size = transport.world_size();
        Self {
            inner: Arc::new(GroupInner {
                id: fnv1a_words(&[world_size as u64]),
                ranks: (0..world_size).collect(),
                me: transport.rank(),
                seq: AtomicU64::new(0),
                counts: Default::default(),
                busy_ns: AtomicU64::new(0),
                transport,
                options,
                created: Arc::default(),
                rendezvous,
                #[cfg(feature = "cuda")]
                nccl: Mutex::default(),
            }),
        }
    }

    /// A world of `world_size` ranks that are threads of this process (the `local` transport):
    /// returns one handle per rank; move each to its own thread.
    pub fn local_world(world_size: usize, options: CommOptions) -> Result<Vec<Self>, CommError> {
        if world_size == 0 {
            return Err(CommError::InvalidGroup(
                "world size 0: a world needs at least one rank".into(),
            ));
        }
        Ok(LocalTransport::world(world_size)
            .into_iter()
            .map(|t| Self::world(Arc::new(t), options.clone(), None))
            .collect())
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.inner.me
    }

    /// The number of ranks in the group.
    pub fn size(&self) -> usize {
        self.inner.ranks.len()
    }

    /// This rank's index in the world.
    pub fn global_rank(&self) -> usize {
        self.inner.ranks[self.inner.me]
    }

    /// The world ranks of the group's members, in group-rank order.
    pub fn global_ranks(&self) -> &[usize] {
        &self.inner.ranks
    }

    /// "local" or "tcp".
    pub fn transport_name(&self) -> &'static str {
        self.inner.transport.name()
    }

    pub fn options(&self) -> &CommOptions {
        &self.inner.options
    }

    /// How many collectives of kind `op` this rank has issued on this group (clones included).
    pub fn op_count(&self, op: OpKind) -> u64 {
        self.inner.counts[op as usize].load(Ordering::Relaxed)
    }

    /// The time this rank has spent inside collectives on this group (clones included), each
    /// from its start to its return, waiting for slower ranks included.
    pub fn comm_time(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.inner.busy_ns.load(Ordering::Relaxed))
    }

    /// "world (8 ranks)" or "group [4, 5, 6, 7]": how errors name the group.
    pub fn describe(&self) -> String {
        let ranks = &self.inner.ranks;
        if ranks.len() == self.inner.transport.world_size()
            && ranks.iter().enumerate().all(|(i, r)| i == *r)
        {
            format!("world ({} ranks)", ranks.len())
        } else {
            format!("group {ranks:?}")
        }
    }

    /// The group of the given members of this group (`ranks` are ranks *of this group*).
    ///
    /// Only members call it, and they create their sub-groups in the same order; no message is
    /// exchanged. Errors when this rank is not a member, or for empty, repeated or out-of-range
    /// ranks.
    pub fn subgroup(&self, ranks: &[usize]) -> Result<Self, CommError> {
        let size = self.size();
        if ranks.is_empty() {
            return Err(CommError::InvalidGroup(format!(
                "empty rank list for a sub-group of {}",
                self.describe()
            )));
        }
        if let Some(bad) = ranks.iter().find(|r| **r >= size) {
            return Err(CommError::InvalidGroup(format!(
                "rank {bad} is out of range for a sub-group of {} (size {size}); ranks given: {ranks:?}",
                self.describe()
            )));
        }
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(CommError::InvalidGroup(format!(
                "rank {} appears twice in {ranks:?}",
                w[0]
            )));
        }
        let me = ranks
            .iter()
            .position(|r| *r == self.rank())
            .ok_or_else(|| {
                CommError::InvalidGroup(format!(
                    "rank {} of {} is not in the sub-group {ranks:?} it tried to create",
                    self.rank(),
                    self.describe()
                ))
            })?;
        let global: Vec<usize> = ranks.iter().map(|r| self.inner.ranks[*r]).collect();
        let instance = {
            let mut created = self.inner.created.lock().unwrap_or_else(|e| e.into_inner());
            let count = created.entry(global.clone()).or_insert(0);
            *count += 1;
            *count
        };
        let mut parts: Vec<u64> = global.iter().map(|r| *r as u64).collect();
        parts.push(u64::MAX);
        parts.push(instance);
        Ok(Self {
            inner: Arc::new(GroupInner {
                id: fnv1a_words(&parts),
                ranks: global,
                me,
                seq: AtomicU64::new(0),
                counts: Default::default(),
                busy_ns: AtomicU64::new(0),
                transport: self.inner.transport.clone(),
                options: self.inner.options.clone(),
                created: self.inner.created.clone(),
                rendezvous: self.inner.rendezvous.clone(),
                #[cfg(feature = "cuda")]
                nccl: Mutex::default(),
            }),
        })
    }

    /// Starts a collective: takes its sequence number, and in debug mode checks that every rank
    /// is starting the same one.
    pub(crate) fn begin(
        &self,
        op: OpKind,
        dtype: WireDType,
        shape: &[usize],
        arg: u64,
    ) -> Result<OpCtx<'_>, CommError> {
        let seq = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        self.inner.counts[op as usize].fetch_add(1, Ordering::Relaxed);
        let ctx = OpCtx {
            group: self,
            desc: Descriptor {
                op,
                seq,
                dtype,
                shape: shape.to_vec(),
                arg,
            },
            started: Instant::now(),
            deadline: Instant::now() + self.inner.options.timeout,
        };
        if self.inner.options.debug && self.size() > 1 {
            ctx.check_agreement()?;
        }
        Ok(ctx)
    }

    pub(crate) fn invalid(&self, op: OpKind, detail: String) -> CommError {
        CommError::InvalidArgument {
            op,
            group: self.describe(),
            detail,
        }
    }

    /// Checks that `peer` names another member of this group.
    pub(crate) fn check_peer(&self, op: OpKind, peer: usize, role: &str) -> Result<(), CommError> {
        if peer >= self.size() {
            return Err(self.invalid(
                op,
                format!(
                    "{role} rank {peer} is outside the group (size {})",
                    self.size()
                ),
            ));
        }
        if peer == self.rank() {
            return Err(self.invalid(op, format!("rank {peer} cannot {} itself", op.name())));
        }
        Ok(())
    }
}

/// One collective in progress on this rank.
pub(crate) struct OpCtx<'a> {
    pub(crate) group: &'a ProcessGroup,
    pub(crate) desc: Descriptor,
    started: Instant,
    pub(crate) deadline: Instant,
}

impl Drop for OpCtx<'_> {
    fn drop(&mut self) {
        let nanos = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.group.inner.busy_ns.fetch_add(nanos, Ordering::Relaxed);
    }
}

impl OpCtx<'_> {
    fn key(&self, channel: Channel, part: u32) -> Key {
        Key {
            group: self.group.inner.id,
            channel,
            id: self.desc.seq,
            part,
        }
    }

    fn global(&self, peer: usize) -> usize {
        self.group.inner.ranks[peer]
    }

    /// Sends `payload` to group rank `peer` as step `part` of this collective.
    pub(crate) fn send(&self, peer: usize, part: u32, payload: Payload) -> Result<(), CommError> {
        self.send_on(Channel::Collective, peer, part, payload)
    }

    fn send_on(
        &self,
        channel: Channel,
        peer: usize,
        part: u32,
        payload: Payload,
    ) -> Result<(), CommError> {
        let message = Message {
            key: self.key(channel, part),
            desc: self.desc.clone(),
            payload,
        };
        let global = self.global(peer);
        self.group
            .inner
            .transport
            .send(global, message)
            .map_err(|reason| self.lost(global, reason, vec![global]))
    }

    /// Receives step `part` from each of `peers` (group ranks), in order, checking that each
    /// sender runs the same op with the same dtype and argument.
    pub(crate) fn recv_all(&self, peers: &[usize], part: u32) -> Result<Vec<Message>, CommError> {
        self.recv_all_on(Channel::Collective, peers, part)
    }

    /// As [`recv_all`](Self::recv_all) for one peer.
    pub(crate) fn recv(&self, peer: usize, part: u32) -> Result<Message, CommError> {
        let mut messages = self.recv_all(&[peer], part)?;
        Ok(messages.remove(0))
    }

    fn recv_all_on(
        &self,
        channel: Channel,
        peers: &[usize],
        part: u32,
    ) -> Result<Vec<Message>, CommError> {
        let key = self.key(channel, part);
        let mailbox = self.group.inner.transport.mailbox();
        let mut messages = Vec::with_capacity(peers.len());
        for (i, &peer) in peers.iter().enumerate() {
            let global = self.global(peer);
            match mailbox.take(global, key, self.deadline) {
                Ok(message) => {
                    if channel == Channel::Collective {
                        self.check_same_op(peer, &message.desc)?;
                    }
                    messages.push(message);
                }
                Err(failure) => {
                    let missing: Vec<usize> = peers[i..]
                        .iter()
                        .map(|p| self.global(*p))
                        .filter(|g| *g == global || !mailbox.has(*g, key))
                        .collect();
                    return Err(match failure {
                        RecvFailure::Timeout => CommError::Timeout {
                            op: self.desc.op,
                            seq: self.desc.seq,
                            group: self.group.describe(),
                            missing,
                            waited: self.started.elapsed(),
                        },
                        RecvFailure::PeerLost(reason) => self.lost(global, reason, missing),
                    });
                }
            }
        }
        Ok(messages)
    }

    fn lost(&self, rank: usize, reason: String, missing: Vec<usize>) -> CommError {
        CommError::PeerLost {
            op: self.desc.op,
            seq: self.desc.seq,
            group: self.group.describe(),
            rank,
            reason,
            missing,
        }
    }

    pub(crate) fn mismatch(&self, peer: usize, detail: String) -> CommError {
        CommError::Mismatch {
            op: self.desc.op,
            seq: self.desc.seq,
            group: self.group.describe(),
            rank: self.global(peer),
            detail,
        }
    }

    fn check_same_op(&self, peer: usize, theirs: &Descriptor) -> Result<(), CommError> {
        let mine = &self.desc;
        if theirs.op != mine.op || theirs.dtype != mine.dtype || theirs.arg != mine.arg {
            return Err(self.mismatch(
                peer,
                format!(
                    "it issued {} while this rank (rank {}) issued {}",
                    show(theirs),
                    self.global(self.group.rank()),
                    show(mine)
                ),
            ));
        }
        Ok(())
    }

    /// Fails unless `peer` sent the same shape as this rank.
    pub(crate) fn check_same_shape(
        &self,
        peer: usize,
        theirs: &Descriptor,
    ) -> Result<(), CommError> {
        if theirs.shape != self.desc.shape {
            return Err(self.mismatch(
                peer,
                format!(
                    "its tensor has shape {:?} but rank {}'s has shape {:?}; {} needs the same shape on every rank",
                    theirs.shape,
                    self.global(self.group.rank()),
                    self.desc.shape,
                    self.desc.op
                ),
            ));
        }
        Ok(())
    }

    /// Debug mode: every rank sends its descriptor to every other; the first rank (in group
    /// order) whose descriptor differs from group rank 0's is named. Every rank sees the same
    /// descriptors, so every rank reports the same rank.
    fn check_agreement(&self) -> Result<(), CommError> {
        let me = self.group.rank();
        let peers: Vec<usize> = (0..self.group.size()).filter(|p| *p != me).collect();
        for &peer in &peers {
            self.send_on(Channel::Debug, peer, 0, Payload::empty())?;
        }
        let received = self.recv_all_on(Channel::Debug, &peers, 0)?;
        let mut all: Vec<&Descriptor> = received.iter().map(|m| &m.desc).collect();
        all.insert(me, &self.desc);
        let reference = all[0];
        if let Some((rank, desc)) = all
            .iter()
            .enumerate()
            .skip(1)
            .find(|(_, d)| !agrees(d, reference))
        {
            return Err(self.mismatch(
                rank,
                format!(
                    "debug check: it issued {} while group rank 0 (rank {}) issued {}",
                    show(desc),
                    self.global(0),
                    show(reference)
                ),
            ));
        }
        Ok(())
    }
}

/// Two descriptors agree when op, sequence number, dtype and argument are equal, and so are the
/// shapes, except along the gathered dimension of an all-gather (ranks may contribute different
/// row counts there).
fn agrees(a: &Descriptor, b: &Descriptor) -> bool {
    let shapes_agree = if a.op == OpKind::AllGather {
        let dim = a.arg as usize;
        a.shape.len() == b.shape.len()
            && a.shape
                .iter()
                .zip(&b.shape)
                .enumerate()
                .all(|(d, (x, y))| d == dim || x == y)
    } else {
        a.shape == b.shape
    };
    a.op == b.op && a.seq == b.seq && a.dtype == b.dtype && a.arg == b.arg && shapes_agree
}

fn show(d: &Descriptor) -> String {
    format!(
        "{} #{} (dtype {:?}, shape {:?}, arg {})",
        d.op, d.seq, d.dtype, d.shape, d.arg
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_positive_and_at_most_a_year() {
        assert_eq!(parse_timeout("2.5"), Some(Duration::from_millis(2500)));
        for bad in ["0", "-1", "soon", "NaN", "inf", "1e30"] {
            assert_eq!(parse_timeout(bad), None, "{bad}");
        }
    }
}
