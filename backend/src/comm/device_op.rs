//! The collectives that also run on device buffers (NCCL, feature `cuda`): what the tensor API
//! (`comm::tensor`) hands the device path (`comm::nccl_tensor`) when a tensor lives on a CUDA
//! device. Each carries its arguments: the reduction, and the dimension or root.

use super::element::ReduceOp;

/// A collective that also runs on device buffers.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum DeviceOp {
    AllReduce(ReduceOp),
    AllGather(usize),
    ReduceScatter(usize, ReduceOp),
    Broadcast(usize),
}
