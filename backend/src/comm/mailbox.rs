//! Messages and the per-rank mailbox both transports deliver into.
//!
//! A message is addressed by its sender and a [`Key`]; the receiver asks for exactly that pair,
//! so messages of different collectives, phases or tags never mix, whatever order they arrive in.
//! Messages with the same sender and key are delivered first-in first-out.

use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use super::buffer::Payload;
use super::element::WireDType;

/// What a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Channel {
    /// Data of the `seq`-th collective of a group.
    Collective,
    /// The descriptor exchanged before a collective in debug mode.
    Debug,
    /// A tagged point-to-point message.
    PointToPoint,
}

impl Channel {
    pub(crate) fn code(self) -> u8 {
        match self {
            Channel::Collective => 0,
            Channel::Debug => 1,
            Channel::PointToPoint => 2,
        }
    }
    pub(crate) fn from_code(code: u8) -> Option<Self> {
        [Channel::Collective, Channel::Debug, Channel::PointToPoint]
            .into_iter()
            .find(|c| c.code() == code)
    }
}

/// The address of a message, besides its sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    /// The group's id (the same on every member).
    pub group: u64,
    pub channel: Channel,
    /// The collective's sequence number in the group, or the point-to-point tag.
    pub id: u64,
    /// The step within a collective (phase and piece).
    pub part: u32,
}

/// What the sender was doing: checked by the receiver, so that ranks running different
/// collectives, dtypes or shapes fail with a clear error instead of mixing data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Descriptor {
    pub op: OpKind,
    pub seq: u64,
    pub dtype: WireDType,
    pub shape: Vec<usize>,
    /// The op's argument: reduce op, root, or dimensions, encoded by the op.
    pub arg: u64,
}

/// The collectives, named as in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    AllToAll,
    Barrier,
    Send,
    Recv,
}

impl OpKind {
    pub(crate) const ALL: [OpKind; 8] = [
        OpKind::AllReduce,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::Broadcast,
        OpKind::AllToAll,
        OpKind::Barrier,
        OpKind::Send,
        OpKind::Recv,
    ];
    /// The op's name, as users call it.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::Broadcast => "broadcast",
            OpKind::AllToAll => "all_to_all",
            OpKind::Barrier => "barrier",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
        }
    }
    pub(crate) fn code(self) -> u8 {
        self as u8
    }
    pub(crate) fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|o| o.code() == code)
    }
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Message {
    pub key: Key,
    pub desc: Descriptor,
    pub payload: Payload,
}

/// Why a receive failed.
#[derive(Debug)]
pub(crate) enum RecvFailure {
    Timeout,
    /// The sender is gone; the text says how we know.
    PeerLost(String),
}

#[derive(Default)]
struct Slots {
    queues: HashMap<(usize, Key), VecDeque<Message>>,
    lost: HashMap<usize, String>,
}

/// Incoming messages of one rank, keyed by sender and key.
#[derive(Default)]
pub(crate) struct Mailbox {
    slots: Mutex<Slots>,
    arrived: Condvar,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, Slots> {
        // A panic while holding this lock cannot leave the map half-updated, so poison is harmless.
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn deliver(&self, src: usize, message: Message) {
        self.lock()
            .queues
            .entry((src, message.key))
            .or_default()
            .push_back(message);
        self.arrived.notify_all();
    }

    /// Records that `src` will send nothing more; pending receives from it fail.
    pub(crate) fn mark_lost(&self, src: usize, reason: String) {
        self.lock().lost.entry(src).or_insert(reason);
        self.arrived.notify_all();
    }

    /// Whether `src` is known to be gone, and why.
    pub(crate) fn lost_reason(&self, src: usize) -> Option<String> {
        self.lock().lost.get(&src).cloned()
    }

    /// Whether a message is waiting (used to name every missing rank in a timeout).
    pub(crate) fn has(&self, src: usize, key: Key) -> bool {
        self.lock()
            .queues
            .get(&(src, key))
            .is_some_and(|q| !q.is_empty())
    }

    /// Waits for the next message from `src` with `key`, until `deadline`.
    pub(crate) fn take(
        &self,
        src: usize,
        key: Key,
        deadline: Instant,
    ) -> Result<Message, RecvFailure> {
        let mut slots = self.lock();
        loop {
            if let Some(queue) = slots.queues.get_mut(&(src, key))
                && let Some(message) = queue.pop_front()
            {
                if queue.is_empty() {
                    slots.queues.remove(&(src, key));
                }
                return Ok(message);
            }
            if let Some(reason) = slots.lost.get(&src) {
                return Err(RecvFailure::PeerLost(reason.clone()));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(RecvFailure::Timeout);
            }
            slots = self
                .arrived
                .wait_timeout(slots, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}
