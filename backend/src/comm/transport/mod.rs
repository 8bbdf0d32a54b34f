//! Transports move [`Message`]s between the ranks of the world; everything above them (the
//! collective algorithms, the tensor API) is written once against this trait.

mod frame;
pub(crate) mod local;
pub(crate) mod shm;
pub(crate) mod tcp;

use super::mailbox::{Mailbox, Message};

/// One rank's connection to every other rank of the world.
pub(crate) trait Transport: Send + Sync {
    /// This process's (or thread's) global rank.
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// A short name for reports: "local", "shm" or "tcp".
    fn name(&self) -> &'static str;
    /// Large transfers are cut into pieces of at most this many bytes so that receiving one
    /// piece overlaps reducing the previous one. `usize::MAX` where transfers cost nothing.
    fn piece_bytes(&self) -> usize;
    /// Whether payload views reach the sender's memory itself (ranks share an address space), so
    /// a receiver may write results back into a region the sender granted it.
    fn shares_memory(&self) -> bool;
    /// Queues a message for `dst` (a global rank, not this one) and returns without waiting for
    /// delivery. Errors with the reason when `dst` is known to be gone.
    fn send(&self, dst: usize, message: Message) -> Result<(), String>;
    /// Where messages to this rank arrive.
    fn mailbox(&self) -> &Mailbox;
}
