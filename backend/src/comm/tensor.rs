//! The tensor API: collectives on Burn tensors of any backend, kind and supported dtype.
//!
//! This is the one place tensors meet host buffers: a tensor is read into a `Vec` of its own
//! element type (no copy on CPU backends when the tensor is not shared), the host collective runs,
//! and the result becomes a tensor of the same dtype on the same device.

use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Element, Tensor, TensorData};

use super::algorithms::{HostTensor, message_into_host};
use super::device_op::DeviceOp;
use super::element::{CommElem, ReduceOp, WireDType, with_elem_type};
use super::error::CommError;
use super::group::ProcessGroup;
use super::mailbox::OpKind;
use super::nccl_tensor;
use crate::decorator::reads::CollectiveRead;
use crate::host_data::host_values;

/// A host collective, run for whichever element type the tensor holds.
pub(crate) trait HostOp {
    const OP: OpKind;
    fn run<E: CommElem>(
        &self,
        group: &ProcessGroup,
        input: HostTensor<E>,
    ) -> Result<HostTensor<E>, CommError>;

    /// The same collective on device buffers, where one exists.
    fn on_device(&self) -> Option<DeviceOp> {
        None
    }
}

fn tensor_error(op: OpKind, detail: impl std::fmt::Display) -> CommError {
    CommError::TensorData {
        op,
        detail: detail.to_string(),
    }
}

fn wire_dtype(op: OpKind, dtype: burn::tensor::DType) -> Result<WireDType, CommError> {
    WireDType::from_burn(dtype).ok_or_else(|| {
        tensor_error(
            op,
            format!("dtype {dtype:?} is not supported (f32, f64, f16, bf16, i32, i64, u8 are)"),
        )
    })
}

fn to_host<E: CommElem>(op: OpKind, data: TensorData) -> Result<HostTensor<E>, CommError> {
    let shape = data.shape.as_slice().to_vec();
    let values = host_values::<E>(data).map_err(|e| tensor_error(op, format!("{e:?}")))?;
    Ok(HostTensor {
        data: values,
        shape,
    })
}

/// Runs a host collective on tensor data of any supported dtype; the result keeps the dtype.
pub(crate) fn run_on_data<O: HostOp>(
    group: &ProcessGroup,
    data: TensorData,
    op: O,
) -> Result<TensorData, CommError> {
    let wire = wire_dtype(O::OP, data.dtype)?;
    with_elem_type!(wire, E => {
        let output = op.run::<E>(group, to_host::<E>(O::OP, data)?)?;
        Ok(TensorData::new(output.data, output.shape))
    })
}

/// Runs `op` on the device buffers of a CUDA tensor (see `nccl_tensor`), else through host
/// memory.
fn run_collective<B, const D: usize, K, O>(
    group: &ProcessGroup,
    tensor: Tensor<B, D, K>,
    op: O,
) -> Result<Tensor<B, D, K>, CommError>
where
    B: Backend,
    K: BasicOps<B> + 'static,
    K::Elem: Element,
    O: HostOp,
{
    let Some(device_op) = op.on_device() else {
        return through_host(group, tensor, op);
    };
    match nccl_tensor::try_collective::<_, B>(group, tensor.into_primitive(), device_op) {
        Ok(result) => result.map(Tensor::from_primitive),
        Err(primitive) => through_host(group, Tensor::from_primitive(primitive), op),
    }
}

fn through_host<B, const D: usize, K, O>(
    group: &ProcessGroup,
    tensor: Tensor<B, D, K>,
    op: O,
) -> Result<Tensor<B, D, K>, CommError>
where
    B: Backend,
    K: BasicOps<B>,
    K::Elem: Element,
    O: HostOp,
{
    let device = tensor.device();
    let dtype = tensor.dtype();
    let _transfer = CollectiveRead::start();
    let data = tensor
        .try_into_data()
        .map_err(|e| tensor_error(O::OP, format!("{e:?}")))?;
    let output = run_on_data(group, data, op)?;
    check_rank::<D>(O::OP, &output)?;
    Ok(Tensor::from_data(output, (&device, dtype)))
}

fn check_rank<const D: usize>(op: OpKind, data: &TensorData) -> Result<(), CommError> {
    if data.shape.num_dims() != D {
        return Err(tensor_error(
            op,
            format!(
                "received a tensor of shape {:?}, expected rank {D}",
                data.shape.as_slice()
            ),
        ));
    }
    Ok(())
}

pub(crate) struct AllReduce(pub(crate) ReduceOp);
impl HostOp for AllReduce {
    const OP: OpKind = OpKind::AllReduce;
    fn on_device(&self) -> Option<DeviceOp> {
        Some(DeviceOp::AllReduce(self.0))
    }
    fn run<E: CommElem>(
        &self,
        g: &ProcessGroup,
        x: HostTensor<E>,
    ) -> Result<HostTensor<E>, CommError> {
        g.all_reduce_host(x, self.0)
    }
}

pub(crate) struct AllGather(pub(crate) usize);
impl HostOp for AllGather {
    const OP: OpKind = OpKind::AllGather;
    fn on_device(&self) -> Option<DeviceOp> {
        Some(DeviceOp::AllGather(self.0))
    }
    fn run<E: CommElem>(
        &self,
        g: &ProcessGroup,
        x: HostTensor<E>,
    ) -> Result<HostTensor<E>, CommError> {
        g.all_gather_host(x, self.0)
    }
}

pub(crate) struct ReduceScatter(pub(crate) usize, pub(crate) ReduceOp);
impl HostOp for ReduceScatter {
    const OP: OpKind = OpKind::ReduceScatter;
    fn on_device(&self) -> Option<DeviceOp> {
        Some(DeviceOp::ReduceScatter(self.0, self.1))
    }
    fn run<E: CommElem>(
        &self,
        g: &ProcessGroup,
        x: HostTensor<E>,
    ) -> Result<HostTensor<E>, CommError> {
        g.reduce_scatter_host(x, self.0, self.1)
    }
}

pub(crate) struct Broadcast(pub(crate) usize);
impl HostOp for Broadcast {
    const OP: OpKind = OpKind::Broadcast;
    fn on_device(&self) -> Option<DeviceOp> {
        Some(DeviceOp::Broadcast(self.0))
    }
    fn run<E: CommElem>(
        &self,
        g: &ProcessGroup,
        x: HostTensor<E>,
    ) -> Result<HostTensor<E>, CommError> {
        g.broadcast_host(x, self.0)
    }
}

pub(crate) struct AllToAll(pub(crate) usize, pub(crate) usize);
impl HostOp for AllToAll {
    const OP: OpKind = OpKind::AllToAll;
    fn run<E: CommElem>(
        &self,
        g: &ProcessGroup,
        x: HostTensor<E>,
    ) -> Result<HostTensor<E>, CommError> {
        g.all_to_all_host(x, self.0, self.1)
    }
}

impl ProcessGroup {
    /// Sends tensor data to group rank `dst` under `tag`.
    pub(crate) fn send_data(
        &self,
        data: TensorData,
        dst: usize,
        tag: u64,
    ) -> Result<(), CommError> {
        let wire = wire_dtype(OpKind::Send, data.dtype)?;
        with_elem_type!(wire, E => self.send_host(to_host::<E>(OpKind::Send, data)?, dst, tag))
    }

    /// Receives the tensor data group rank `src` sent under `tag`, in the sender's dtype.
    pub(crate) fn recv_data(&self, src: usize, tag: u64) -> Result<TensorData, CommError> {
        let message = self.recv_message(src, tag)?;
        with_elem_type!(message.payload.dtype(), E => {
            let output = message_into_host::<E>(self, message, src)?;
            Ok(TensorData::new(output.data, output.shape))
        })
    }

    /// Every rank gets `op` (sum, mean, max, min) over all ranks' tensors, bitwise identical on
    /// every rank (see [`ReduceOp`] for the fold order). Shapes must match across ranks.
    pub fn all_reduce<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        op: ReduceOp,
    ) -> Result<Tensor<B, D, K>, CommError>
    where
        K::Elem: Element,
    {
        run_collective(self, tensor, AllReduce(op))
    }

    /// Concatenation of all ranks' tensors along `dim`, in rank order.
    pub fn all_gather<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        dim: usize,
    ) -> Result<Tensor<B, D, K>, CommError>
    where
        K::Elem: Element,
    {
        run_collective(self, tensor, AllGather(dim))
    }

    /// This rank's part, along `dim`, of `op` over all ranks' tensors. With `S` rows and `n`
    /// ranks, the first `S mod n` ranks get `⌈S/n⌉` rows and the rest `⌊S/n⌋`.
    pub fn reduce_scatter<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        dim: usize,
        op: ReduceOp,
    ) -> Result<Tensor<B, D, K>, CommError>
    where
        K::Elem: Element,
    {
        run_collective(self, tensor, ReduceScatter(dim, op))
    }

    /// `root`'s tensor, on every rank. Every rank passes a tensor of the root's shape.
    pub fn broadcast<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        root: usize,
    ) -> Result<Tensor<B, D, K>, CommError>
    where
        K::Elem: Element,
    {
        run_collective(self, tensor, Broadcast(root))
    }

    /// Part q of the tensor along `scatter_dim` goes to rank q; the parts received are
    /// concatenated along `gather_dim` in rank order.
    pub fn all_to_all<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        scatter_dim: usize,
        gather_dim: usize,
    ) -> Result<Tensor<B, D, K>, CommError>
    where
        K::Elem: Element,
    {
        run_collective(self, tensor, AllToAll(scatter_dim, gather_dim))
    }

    /// Sends a tensor to group rank `dst` under `tag`; returns once it is queued.
    pub fn send<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        dst: usize,
        tag: u64,
    ) -> Result<(), CommError>
    where
        K::Elem: Element,
    {
        let _transfer = CollectiveRead::start();
        let data = tensor
            .try_into_data()
            .map_err(|e| tensor_error(OpKind::Send, format!("{e:?}")))?;
        self.send_data(data, dst, tag)
    }

    /// Receives the next tensor group rank `src` sent under `tag`, with the sender's shape and
    /// dtype, on `device`.
    pub fn recv<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        src: usize,
        tag: u64,
        device: &B::Device,
    ) -> Result<Tensor<B, D, K>, CommError>
    where
        K::Elem: Element,
    {
        let data = self.recv_data(src, tag)?;
        check_rank::<D>(OpKind::Recv, &data)?;
        let dtype = data.dtype;
        Ok(Tensor::from_data(data, (device, dtype)))
    }
}
