//! The `local` transport: ranks are threads of one process. A send moves a [`Message`] into the
//! receiver's mailbox; its payload is a view of the sender's buffer, so no byte is copied until an
//! algorithm reads it.

use std::sync::Arc;

use super::Transport;
use crate::comm::mailbox::{Mailbox, Message};

pub(crate) struct LocalTransport {
    rank: usize,
    mailboxes: Arc<Vec<Mailbox>>,
}

impl LocalTransport {
    /// One transport per rank of a world of `world_size` threads.
    pub(crate) fn world(world_size: usize) -> Vec<LocalTransport> {
        let mailboxes: Arc<Vec<Mailbox>> =
            Arc::new((0..world_size).map(|_| Mailbox::default()).collect());
        (0..world_size)
            .map(|rank| LocalTransport {
                rank,
                mailboxes: mailboxes.clone(),
            })
            .collect()
    }
}

impl Transport for LocalTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.mailboxes.len()
    }
    fn name(&self) -> &'static str {
        "local"
    }
    fn shares_memory(&self) -> bool {
        true
    }
    fn piece_bytes(&self) -> usize {
        usize::MAX
    }
    fn send(&self, dst: usize, message: Message) -> Result<(), String> {
        if let Some(reason) = self.mailbox().lost_reason(dst) {
            return Err(reason);
        }
        self.mailboxes[dst].deliver(self.rank, message);
        Ok(())
    }
    fn mailbox(&self) -> &Mailbox {
        &self.mailboxes[self.rank]
    }
}

impl Drop for LocalTransport {
    /// A rank whose thread ends (or panics) leaves the world: its peers stop waiting for it.
    fn drop(&mut self) {
        let reason = if std::thread::panicking() {
            format!("rank {} panicked", self.rank)
        } else {
            format!("rank {} closed its process group", self.rank)
        };
        for (rank, mailbox) in self.mailboxes.iter().enumerate() {
            if rank != self.rank {
                mailbox.mark_lost(self.rank, reason.clone());
            }
        }
    }
}
