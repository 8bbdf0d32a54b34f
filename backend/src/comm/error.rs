//! Errors of the communication layer. Each names the op, its sequence number in the group, the
//! group, and the ranks involved, so a failure on rank 37 of 64 can be read without a debugger.

use std::time::Duration;

use thiserror::Error;

use super::mailbox::OpKind;

/// What went wrong in a collective, a point-to-point call, or while setting up a group.
#[derive(Debug, Error)]
pub enum CommError {
    /// A world or group that cannot exist.
    #[error("invalid process group: {0}")]
    InvalidGroup(String),

    /// A bad argument to an operation (peer, root, dimension, dtype).
    #[error("{op} in {group}: {detail}")]
    InvalidArgument {
        op: OpKind,
        group: String,
        detail: String,
    },

    /// Some peers did not take part before the deadline.
    #[error(
        "{op} #{seq} in {group} timed out after {:.1} s waiting for rank(s) {missing:?} \
         (global ranks); they may be stuck, slow, or running a different collective",
        waited.as_secs_f64()
    )]
    Timeout {
        op: OpKind,
        seq: u64,
        group: String,
        missing: Vec<usize>,
        waited: Duration,
    },

    /// A peer is gone (its process exited or its connection broke).
    #[error("{op} #{seq} in {group}: rank {rank} is gone ({reason}); missing rank(s) {missing:?}")]
    PeerLost {
        op: OpKind,
        seq: u64,
        group: String,
        rank: usize,
        reason: String,
        missing: Vec<usize>,
    },

    /// Ranks disagree on what they are doing (op, sequence number, dtype or shape).
    #[error("{op} #{seq} in {group}: rank {rank} disagrees: {detail}")]
    Mismatch {
        op: OpKind,
        seq: u64,
        group: String,
        rank: usize,
        detail: String,
    },

    /// No usable CUDA driver or device, or a CUDA driver call that failed.
    #[error("CUDA: {0}")]
    Cuda(String),

    /// Loading NCCL, or an NCCL call that failed.
    #[error("NCCL: {0}")]
    Nccl(String),

    /// Setting up the job: the store, addresses, launch variables.
    #[error("rendezvous: {0}")]
    Rendezvous(String),

    /// Converting a tensor to host memory or back.
    #[error("{op}: tensor data: {detail}")]
    TensorData { op: OpKind, detail: String },

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl CommError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        CommError::Io {
            context: context.into(),
            source,
        }
    }
}
