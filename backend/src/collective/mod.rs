//! Collectives on tensor primitives, as a backend extension, and the autodiff-aware functions of
//! tensor and sequence parallelism (Megatron-LM's f and g operators and their relatives).
//!
//! Every collective here is a pair of [`Mapping`]s: what happens to the tensor going forward and
//! what happens to its gradient going back. On `Parallel<B>` only the forward runs; on
//! `Autodiff<Parallel<B>>` the backward is recorded in the graph. With `L = Σ_r L_r` the sum of
//! every rank's loss and `g_r = ∂L/∂y_r` the gradient arriving on rank r:
//!
//! | function | forward `y_r` | backward `∂L/∂x_r` |
//! |---|---|---|
//! | [`all_reduce`] (sum) | `Σ_q x_q` | `Σ_q g_q` (all-reduce) |
//! | [`all_reduce`] (mean) | `(Σ_q x_q)/n` | `(Σ_q g_q)/n` (all-reduce mean) |
//! | [`copy_to_parallel_region`] (f) | `x_r` | `Σ_q g_q` (all-reduce) |
//! | [`reduce_from_parallel_region`] (g) | `Σ_q x_q` | `g_r` |
//! | [`scatter_to_parallel_region`] | part r of `x_r` along `dim` | `concat_q g_q` (all-gather) |
//! | [`gather_from_parallel_region`] | `concat_q x_q` along `dim` | part r of `g_r` |
//! | [`reduce_scatter_to_sequence_region`] | part r of `Σ_q x_q` | `concat_q g_q` (all-gather) |
//! | [`all_gather_from_sequence_region`] | `concat_q x_q` | part r of `Σ_q g_q` (reduce-scatter) |
//! | [`all_gather_recomputed`] | `concat_q x_q`, gathered again going back | part r of `Σ_q g_q` |
//!
//! Each backward is the adjoint of its forward: `Σ_r ⟨F(x)_r, y_r⟩ = Σ_r ⟨x_r, Fᵀ(y)_r⟩`.
//! The f/g pairs differ from the plain collectives only in which side communicates: `f` is free
//! going forward because every rank already holds the same `x` (then `Σ_q g_q` is the true
//! gradient of the replicated input), `g` is free going back because every rank holds the same
//! `g` (the loss after `g` is computed redundantly on every rank, so only one copy counts).
//! Parts along `dim` follow the uneven-split rule of `comm`: the first `S mod n` ranks get one
//! row more.
//!
//! A collective that fails in a backward pass panics with the error (Burn's backward cannot
//! return one); forward errors are returned.
//!
//! **Ranks as threads.** Threads of one process share Burn 0.21's autodiff graph registry, and
//! after each backward pass a rank briefly locks every graph in it, including one a peer may be
//! running its next backward pass on while it waits in a collective for this rank. Separate
//! processes (the normal case) never meet this; thread ranks must pass a barrier between
//! backward passes.

mod autodiff;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{Device, FloatTensor, FloatTensorOps};
use burn::tensor::{Slice, Tensor, TensorData, TensorMetadata, TensorPrimitive};

use crate::Parallel;
use crate::comm::{
    AllGather, AllReduce, Broadcast, CommError, DeviceOp, OpKind, ProcessGroup, ReduceOp,
    ReduceScatter, nccl_tensor, run_on_data, split_ranges,
};
use crate::decorator::reads::CollectiveRead;

/// What a collective does to a tensor (or, going back, to its gradient) on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// Nothing: `y_r = x_r`.
    Identity,
    /// `y_r = op_q x_q`.
    AllReduce(ReduceOp),
    /// `y_r = concat_q x_q` along the dimension.
    AllGather(usize),
    /// `y_r = part r of (Σ_q x_q)` along the dimension.
    ReduceScatter(usize),
    /// `y_r = part r of x_r` along the dimension (no communication).
    LocalPart(usize),
}

/// A backend that runs collectives on its own tensor primitives.
///
/// Implemented by [`Parallel<B>`] (forward only) and `Autodiff<Parallel<B>>` (forward, and the
/// backward mapping recorded in the autodiff graph).
pub trait CollectiveBackend: Backend {
    /// Applies `forward` over `group`; on an autodiff backend the gradient goes back through
    /// `backward` (its adjoint), or stops there when `backward` is `None`.
    fn comm_map(
        tensor: FloatTensor<Self>,
        group: &ProcessGroup,
        forward: Mapping,
        backward: Option<Mapping>,
    ) -> Result<FloatTensor<Self>, CommError>;

    /// `root`'s tensor on every rank. The gradient stops here.
    fn comm_broadcast(
        tensor: FloatTensor<Self>,
        group: &ProcessGroup,
        root: usize,
    ) -> Result<FloatTensor<Self>, CommError>;

    /// Sends to group rank `dst` under `tag` (see [`ProcessGroup::send`]).
    fn comm_send(
        tensor: FloatTensor<Self>,
        group: &ProcessGroup,
        dst: usize,
        tag: u64,
    ) -> Result<(), CommError>;

    /// Receives what group rank `src` sent under `tag`, on `device`. The result is a leaf.
    fn comm_recv(
        group: &ProcessGroup,
        src: usize,
        tag: u64,
        device: &Device<Self>,
    ) -> Result<FloatTensor<Self>, CommError>;

    /// All-reduce with its true derivative (sum and mean; max and min stop the gradient).
    fn comm_all_reduce(
        tensor: FloatTensor<Self>,
        group: &ProcessGroup,
        op: ReduceOp,
    ) -> Result<FloatTensor<Self>, CommError> {
        let backward =
            matches!(op, ReduceOp::Sum | ReduceOp::Mean).then_some(Mapping::AllReduce(op));
        Self::comm_map(tensor, group, Mapping::AllReduce(op), backward)
    }

    /// All-gather along `dim`, with its true derivative (reduce-scatter of the gradient).
    fn comm_all_gather(
        tensor: FloatTensor<Self>,
        group: &ProcessGroup,
        dim: usize,
    ) -> Result<FloatTensor<Self>, CommError> {
        Self::comm_map(
            tensor,
            group,
            Mapping::AllGather(dim),
            Some(Mapping::ReduceScatter(dim)),
        )
    }

    /// All-gather along `dim` whose output the backward pass does not keep: a node that needs
    /// it gathers it again (ZeRO 3's parameters, whole only while they are used). The
    /// derivative is [`Self::comm_all_gather`]'s. Only an autodiff backend whose checkpointing
    /// recomputes memory-bound nodes drops the output (see [`Self::recomputes_gathers`]).
    ///
    /// `after` places the node in the backward pass, and gets no gradient from it. Burn runs a
    /// backward pass by depth, deepest first, and a node is one deeper than its deepest parent:
    /// a gather of a parameter (a leaf, depth 0) alone would be among the last nodes run, so
    /// every gathered gradient would wait, whole, for the end of the pass. With the input of
    /// the layer that uses the parameter as `after`, the gradient is reduce-scattered as soon
    /// as the backward pass is back at that layer.
    fn comm_all_gather_recomputed(
        tensor: FloatTensor<Self>,
        group: &ProcessGroup,
        dim: usize,
        after: &FloatTensor<Self>,
    ) -> Result<FloatTensor<Self>, CommError> {
        let _ = after;
        Self::comm_all_gather(tensor, group, dim)
    }

    /// Whether [`Self::comm_all_gather_recomputed`]'s outputs are dropped after the forward
    /// pass and gathered again going back: true without autodiff (nothing is kept) and under
    /// Burn's `BalancedCheckpointing`, false under `NoCheckpointing` (`Autodiff<B>`'s default),
    /// which keeps every output its backward needs.
    fn recomputes_gathers() -> bool {
        true
    }

    /// Reduce-scatter (sum) along `dim`, with its true derivative (all-gather of the gradient).
    fn comm_reduce_scatter(
        tensor: FloatTensor<Self>,
        group: &ProcessGroup,
        dim: usize,
    ) -> Result<FloatTensor<Self>, CommError> {
        Self::comm_map(
            tensor,
            group,
            Mapping::ReduceScatter(dim),
            Some(Mapping::AllGather(dim)),
        )
    }
}

impl Mapping {
    /// Runs the mapping on a primitive of backend `B`.
    pub(crate) fn apply<B: Backend>(
        self,
        tensor: FloatTensor<B>,
        group: &ProcessGroup,
    ) -> Result<FloatTensor<B>, CommError> {
        let device_op = match self {
            Mapping::AllReduce(op) => Some(DeviceOp::AllReduce(op)),
            Mapping::AllGather(dim) => Some(DeviceOp::AllGather(dim)),
            Mapping::ReduceScatter(dim) => Some(DeviceOp::ReduceScatter(dim, ReduceOp::Sum)),
            Mapping::Identity | Mapping::LocalPart(_) => None,
        };
        let tensor = match device_op {
            Some(op) => match on_device::<B>(tensor, group, op) {
                Ok(result) => return result,
                Err(tensor) => tensor,
            },
            None => tensor,
        };
        match self {
            Mapping::Identity => Ok(tensor),
            Mapping::AllReduce(op) => on_host::<B>(tensor, OpKind::AllReduce, |data| {
                run_on_data(group, data, AllReduce(op))
            }),
            Mapping::AllGather(dim) => on_host::<B>(tensor, OpKind::AllGather, |data| {
                run_on_data(group, data, AllGather(dim))
            }),
            Mapping::ReduceScatter(dim) => on_host::<B>(tensor, OpKind::ReduceScatter, |data| {
                run_on_data(group, data, ReduceScatter(dim, ReduceOp::Sum))
            }),
            Mapping::LocalPart(dim) => local_part::<B>(tensor, group, dim),
        }
    }
}

/// Runs `op` on the device buffers when the primitive is a CUDA tensor (feature `cuda`, see
/// `comm`'s NCCL module); otherwise gives it back for the host path.
fn on_device<B: Backend>(
    tensor: FloatTensor<B>,
    group: &ProcessGroup,
    op: DeviceOp,
) -> Result<Result<FloatTensor<B>, CommError>, FloatTensor<B>> {
    nccl_tensor::try_collective::<_, B>(group, tensor, op)
}

/// Reads a primitive to host memory, runs `f`, and makes a primitive of the result on the same
/// device.
fn on_host<B: Backend>(
    tensor: FloatTensor<B>,
    op: OpKind,
    f: impl FnOnce(TensorData) -> Result<TensorData, CommError>,
) -> Result<FloatTensor<B>, CommError> {
    let device = B::float_device(&tensor);
    let data = read::<B>(tensor, op)?;
    Ok(B::float_from_data(f(data)?, &device))
}

fn read<B: Backend>(tensor: FloatTensor<B>, op: OpKind) -> Result<TensorData, CommError> {
    let unreadable = |detail: String| CommError::TensorData { op, detail };
    let _transfer = CollectiveRead::start();
    burn::tensor::try_read_sync(B::float_into_data(tensor))
        .ok_or_else(|| unreadable("this platform cannot read tensors synchronously".into()))?
        .map_err(|e| unreadable(format!("{e:?}")))
}

/// Part `group.rank()` of the tensor along `dim`, by the uneven-split rule.
fn local_part<B: Backend>(
    tensor: FloatTensor<B>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<FloatTensor<B>, CommError> {
    let shape = tensor.shape();
    if dim >= shape.num_dims() {
        return Err(CommError::InvalidArgument {
            op: OpKind::ReduceScatter,
            group: group.describe(),
            detail: format!(
                "dimension {dim} is out of range for shape {:?}",
                shape.as_slice()
            ),
        });
    }
    let rows = split_ranges(shape[dim], group.size())[group.rank()].clone();
    let slices: Vec<Slice> = (0..shape.num_dims())
        .map(|d| {
            if d == dim {
                Slice::new(rows.start as isize, Some(rows.end as isize), 1)
            } else {
                Slice::new(0, None, 1)
            }
        })
        .collect();
    Ok(B::float_slice(tensor, &slices))
}

impl<B: Backend> CollectiveBackend for Parallel<B> {
    fn comm_map(
        tensor: FloatTensor<Self>,
        group: &ProcessGroup,
        forward: Mapping,
        _backward: Option<Mapping>,
    ) -> Result<FloatTensor<Self>, CommError> {
        forward.apply::<Self>(tensor, group)
    }

    fn comm_broadcast(
        tensor: FloatTensor<Self>,
        group: &ProcessGroup,
        root: usize,
    ) -> Result<FloatTensor<Self>, CommError> {
        let tensor = match on_device::<Self>(tensor, group, DeviceOp::Broadcast(root)) {
            Ok(result) => return result,
            Err(tensor) => tensor,
        };
        on_host::<Self>(tensor, OpKind::Broadcast, |data| {
            run_on_data(group, data, Broadcast(root))
        })
    }

    fn comm_send(
        tensor: FloatTensor<Self>,
        group: &ProcessGroup,
        dst: usize,
        tag: u64,
    ) -> Result<(), CommError> {
        group.send_data(read::<Self>(tensor, OpKind::Send)?, dst, tag)
    }

    fn comm_recv(
        group: &ProcessGroup,
        src: usize,
        tag: u64,
        device: &Device<Self>,
    ) -> Result<FloatTensor<Self>, CommError> {
        Ok(Self::float_from_data(group.recv_data(src, tag)?, device))
    }
}

fn primitive<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> FloatTensor<B> {
    tensor.into_primitive().tensor()
}

fn tensor<B: Backend, const D: usize>(primitive: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

fn map<B: CollectiveBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
    forward: Mapping,
    backward: Mapping,
) -> Result<Tensor<B, D>, CommError> {
    B::comm_map(primitive(x), group, forward, Some(backward)).map(tensor)
}

/// All-reduce with its true derivative (see the module table).
pub fn all_reduce<B: CollectiveBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
    op: ReduceOp,
) -> Result<Tensor<B, D>, CommError> {
    B::comm_all_reduce(primitive(x), group, op).map(tensor)
}

/// Megatron's f: identity forward, all-reduce (sum) of the gradient backward. Put it before a
/// column-parallel layer whose input is replicated.
pub fn copy_to_parallel_region<B: CollectiveBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
) -> Result<Tensor<B, D>, CommError> {
    map(
        x,
        group,
        Mapping::Identity,
        Mapping::AllReduce(ReduceOp::Sum),
    )
}

/// Megatron's g: all-reduce (sum) forward, identity backward. Put it after a row-parallel layer.
pub fn reduce_from_parallel_region<B: CollectiveBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
) -> Result<Tensor<B, D>, CommError> {
    map(
        x,
        group,
        Mapping::AllReduce(ReduceOp::Sum),
        Mapping::Identity,
    )
}

/// Keeps this rank's part along `dim` forward; all-gathers the gradient backward.
pub fn scatter_to_parallel_region<B: CollectiveBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<B, D>, CommError> {
    map(x, group, Mapping::LocalPart(dim), Mapping::AllGather(dim))
}

/// All-gathers along `dim` forward; keeps this rank's part of the gradient backward.
pub fn gather_from_parallel_region<B: CollectiveBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<B, D>, CommError> {
    map(x, group, Mapping::AllGather(dim), Mapping::LocalPart(dim))
}

/// Sequence parallelism: reduce-scatter (sum) along `dim` forward; all-gather backward.
pub fn reduce_scatter_to_sequence_region<B: CollectiveBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<B, D>, CommError> {
    map(
        x,
        group,
        Mapping::ReduceScatter(dim),
        Mapping::AllGather(dim),
    )
}

/// All-gather along `dim` forward, gathered again instead of kept for the backward pass, and
/// reduce-scattered (sum) going back once the backward pass is back at `after` (see
/// [`CollectiveBackend::comm_all_gather_recomputed`]).
pub fn all_gather_recomputed<B: CollectiveBackend, const D: usize, const E: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
    dim: usize,
    after: &Tensor<B, E>,
) -> Result<Tensor<B, D>, CommError> {
    let after = primitive(after.clone());
    B::comm_all_gather_recomputed(primitive(x), group, dim, &after).map(tensor)
}

/// Sequence parallelism: all-gather along `dim` forward; reduce-scatter (sum) backward.
pub fn all_gather_from_sequence_region<B: CollectiveBackend, const D: usize>(
    x: Tensor<B, D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<B, D>, CommError> {
    map(
        x,
        group,
        Mapping::AllGather(dim),
        Mapping::ReduceScatter(dim),
    )
}
