//! Collective communication: process groups, their collectives on Burn tensors, the transports
//! under them, rendezvous and launch-environment detection.
//!
//! ```no_run
//! use wildfire_backend::comm::{CommOptions, LaunchEnv, LaunchFlags, ProcessGroup, ReduceOp};
//! # fn main() -> Result<(), wildfire_backend::comm::CommError> {
//! let env = LaunchEnv::detect(&LaunchFlags::default())?; // RANK, WORLD_SIZE, … from the launcher
//! let world = ProcessGroup::init(&env, CommOptions::from_env()?)?;
//! let tp = world.subgroup(&[0, 1])?;                     // members only, same order everywhere
//! # let _ = (tp, ReduceOp::Sum);
//! # Ok(()) }
//! ```
//!
//! Every collective returns a `Result`; errors name the op, its sequence number in the group, the
//! group and the ranks involved ([`CommError`]). Every blocking call has a deadline
//! ([`CommOptions::timeout`], `WILDFIRE_COMM_TIMEOUT`).

mod algorithms;
pub mod auth;
mod buffer;
mod device_op;
mod element;
mod env;
mod error;
mod group;
mod host_values;
mod init;
mod layout;
mod mailbox;
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod nccl_device;
#[cfg(feature = "cuda")]
pub(crate) mod nccl_tensor;
#[cfg(feature = "cuda")]
mod nccl_watchdog;
/// Without the `cuda` feature no tensor is a CUDA tensor: every collective takes the host path.
#[cfg(not(feature = "cuda"))]
pub(crate) mod nccl_tensor {
    use burn::tensor::backend::Backend;

    use super::device_op::DeviceOp;
    use super::error::CommError;
    use super::group::ProcessGroup;

    #[allow(
        clippy::extra_unused_type_parameters,
        reason = "the signature of the CUDA build's function, which needs B"
    )]
    pub(crate) fn try_collective<P: 'static, B: Backend>(
        _: &ProcessGroup,
        primitive: P,
        _: DeviceOp,
    ) -> Result<Result<P, CommError>, P> {
        Err(primitive)
    }
}
pub mod selfcheck;
mod store;
mod tensor;
mod thread_ranks;
mod transport;

pub use algorithms::HostTensor;
pub(crate) use device_op::DeviceOp;
pub use element::{Accumulator, CommElem, ReduceOp, WireDType};
pub use env::{DEFAULT_MASTER_PORT, LaunchEnv, LaunchFlags, LaunchSource, expand_nodelist};
pub use error::CommError;
pub use group::{
    CommOptions, DEBUG_ENV, ProcessGroup, TIMEOUT_ENV, fnv1a, parse_timeout, timeout_from_secs,
};
pub use layout::{split_ranges, split_sizes};
pub use mailbox::OpKind;
pub use store::{MAX_STORE_CONNECTIONS, StoreClient, StoreServer};
pub(crate) use tensor::{AllGather, AllReduce, Broadcast, ReduceScatter, run_on_data};
pub use thread_ranks::{run_thread_ranks, run_threads_within};
pub use transport::shm::{RING_BYTES_ENV, TRANSPORT_ENV};
pub use transport::tcp::{ADVERTISE_ENV, BIND_ENV};
