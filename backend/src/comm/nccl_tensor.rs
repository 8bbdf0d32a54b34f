//! Collectives on CUDA tensors through NCCL, on the tensors' device buffers (no host copies).
//!
//! **Routing.** A collective whose tensor primitive is a CUDA tensor runs here: CubeCL's
//! `CubeTensor<CudaRuntime>` (Burn's bare CUDA backend) or a tensor of Burn's fusion backend over
//! it (`FusedCuda`, what `--device cuda` runs), directly or inside `Parallel<_>`, which keeps its
//! inner backend's primitives. A fused tensor is resolved through its fusion client first (the
//! fusion queue runs up to it on the host's side; see `crate::fusion`), and the result enters
//! the fusion stream as a new tensor. Every other backend goes through host memory
//! (`comm::tensor`). The test is by type, so all ranks of a group take the same path when they
//! use the same backend. `WILDFIRE_NCCL=0` forces the host path for CUDA tensors too.
//!
//! **Ordering against CubeCL.** By default, before each collective this module allocates the
//! output through CubeCL, resolves both device pointers, and waits for CubeCL's queue
//! (`client.sync()`): the input is then complete and the output memory exists. NCCL runs on the
//! communicator's own stream, and the call returns after NCCL finished (an event polled within
//! the group's deadline, see `nccl_device`), so kernels CubeCL queues afterwards read a finished
//! output. The price is one host synchronisation per collective; nothing is copied.
//!
//! **On CubeCL's stream** (`WILDFIRE_NCCL_STREAM=1`; off by default, not yet run on a GPU): the
//! collective is enqueued on the stream CubeCL launches on, through the CUDA seam
//! (`crate::cuda::stream`), after the kernels that wrote its input and before those that read
//! its output, and returns at once: no host synchronisation. Its deadline is then kept by the
//! communicator's watchdog (`nccl_watchdog`), which ends the process when a collective misses
//! it, as PyTorch's NCCL process group does.
//!
//! **Layout.** NCCL concatenates and splits flat buffers, i.e. along the first dimension of a
//! contiguous tensor. A collective along dimension `d` permutes `d` to the front (a view), makes
//! it contiguous (one device copy, skipped when `d = 0`), runs, and permutes the result back (a
//! view). Equal parts use `ncclAllGather`/`ncclReduceScatter`; uneven parts (the uneven-split
//! rule of `comm`, or all-gather inputs of different sizes) use one NCCL group of broadcasts or
//! reductions rooted at each rank. An all-gather first exchanges shapes over the host transport
//! (a few bytes), which is also how a shape mismatch becomes an error naming the rank.
//!
//! **Numerics.** NCCL chooses its reduction order (ring, tree), so sums may differ in the last
//! bits from the host transport's rank-order fold; each element is reduced once and then
//! copied, so every rank still gets the same bits.
//!
//! **Send and receive stay on the host transport** for now. An `ncclSend` completes only once the
//! peer posts the matching receive, whereas our send returns once queued, and the pipeline
//! schedules are checked against that buffered behaviour (a ring where every rank sends before
//! it receives is fine on the host transport and a deadlock with blocking NCCL sends). Device
//! point-to-point needs sends and receives posted together (`ncclGroupStart`/`End`), which the
//! pipeline executor can do for each step; until then CUDA tensors are sent through host memory.

use std::any::TypeId;
use std::ffi::c_int;
use std::sync::OnceLock;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::permute;
use burn_cubecl::tensor::CubeTensor;
use cubecl::client::ComputeClient;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::future::block_on;
use cubecl::server::Handle;

use super::algorithms::{HostTensor, peers_of};
use super::buffer::Payload;
use super::device_op::DeviceOp;
use super::element::{ReduceOp, WireDType};
use super::error::CommError;
use super::group::ProcessGroup;
use super::layout::split_sizes;
use super::mailbox::OpKind;
use super::nccl::{
    NcclLibrary, RawStream, UNIQUE_ID_BYTES, UniqueId, nccl_dtype, nccl_op, share_unique_id,
};
use super::nccl_device::{NcclComm, NcclMember, check_cuda_driver};
use crate::fusion::{self, FusedTensor};
use crate::typecast::{cast, same};

/// burn-cuda's tensor primitive (float, int and bool alike).
pub(crate) type CudaTensor = CubeTensor<CudaRuntime>;

/// Whether collectives go on CubeCL's stream (`WILDFIRE_NCCL_STREAM=1`; read once).
fn on_cubecl_stream() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("WILDFIRE_NCCL_STREAM").is_ok_and(|v| v == "1"))
}

fn nccl_enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("WILDFIRE_NCCL").map_or(true, |v| v != "0"))
}

/// The fused CUDA tensor of Burn's fusion backend (`FusedCuda`'s primitives).
type FusedCudaTensor = FusedTensor<CudaRuntime>;

/// The CUDA tensor inside `primitive`: an int or bool primitive of a CUDA backend, bare or fused,
/// a float one of backend `B`, or a `TensorPrimitive<B>` holding a float one. A fused tensor is
/// resolved (its fusion stream runs up to it first). `Err` gives back a primitive that holds
/// none (another backend), or all of them when NCCL is switched off.
fn into_cuda<P: 'static, B: Backend>(primitive: P) -> Result<CudaTensor, P> {
    if !nccl_enabled() {
        return Err(primitive);
    }
    let primitive = match cast::<P, CudaTensor>(primitive) {
        Ok(tensor) => return Ok(tensor),
        Err(primitive) => primitive,
    };
    let primitive = match cast::<P, FusedCudaTensor>(primitive) {
        Ok(tensor) => return Ok(fusion::resolve(tensor)),
        Err(primitive) => primitive,
    };
    match cast::<P, TensorPrimitive<B>>(primitive) {
        Ok(TensorPrimitive::Float(tensor)) => into_cuda::<FloatTensor<B>, B>(tensor)
            .map_err(|tensor| same(TensorPrimitive::<B>::Float(tensor))),
        Ok(other) => Err(same(other)),
        Err(primitive) => Err(primitive),
    }
}

/// The primitive of type `P` (as in [`into_cuda`]) holding a CUDA tensor: the tensor itself, or
/// a new tensor of its device's fusion stream where the backend is fused.
fn from_cuda<P: 'static, B: Backend>(tensor: CudaTensor) -> P {
    if is_cuda_primitive::<P>() {
        return as_cuda_primitive(tensor);
    }
    let float: FloatTensor<B> = as_cuda_primitive(tensor);
    same(TensorPrimitive::<B>::Float(float))
}

/// Whether `T` is a CUDA tensor, bare or fused.
fn is_cuda_primitive<T: 'static>() -> bool {
    let t = TypeId::of::<T>();
    t == TypeId::of::<CudaTensor>() || t == TypeId::of::<FusedCudaTensor>()
}

/// `tensor` as a `T` that [`is_cuda_primitive`]: itself, or adopted by the fusion stream.
fn as_cuda_primitive<T: 'static>(tensor: CudaTensor) -> T {
    match TypeId::of::<T>() == TypeId::of::<FusedCudaTensor>() {
        true => same(fusion::adopt(tensor)),
        false => same(tensor),
    }
}

fn cuda_error(what: &str, detail: impl std::fmt::Debug) -> CommError {
    CommError::Cuda(format!("{what}: {detail:?}"))
}

fn wire_dtype(op: OpKind, tensor: &CudaTensor) -> Result<WireDType, CommError> {
    WireDType::from_burn(tensor.dtype).ok_or_else(|| CommError::TensorData {
        op,
        detail: format!(
            "dtype {:?} is not supported (f32, f64, f16, bf16, i32, i64, u8 are)",
            tensor.dtype
        ),
    })
}

/// The group's shared NCCL unique id, created by group rank 0; returns after every rank has it.
fn agree_unique_id(group: &ProcessGroup) -> Result<UniqueId, CommError> {
    let name = format!("group-{:016x}", group.inner.id);
    let (rank, size) = (group.rank(), group.size());
    if let Some(rendezvous) = &group.inner.rendezvous {
        let store = &rendezvous.store;
        let timeout = group.options().timeout;
        let id = share_unique_id(store, &name, rank, timeout, NcclComm::unique_id)?;
        store.barrier(&format!("wildfire/nccl/{name}/init"), size)?;
        return Ok(id);
    }
    let mine = if rank == 0 {
        NcclComm::unique_id()?.to_bytes()
    } else {
        vec![0; UNIQUE_ID_BYTES]
    };
    let shared = group.broadcast_host(HostTensor::new(mine, vec![UNIQUE_ID_BYTES]), 0)?;
    group.barrier()?;
    UniqueId::from_bytes(&shared.data).ok_or_else(|| {
        CommError::Nccl(format!(
            "{name}: rank 0 broadcast {} bytes, not a {UNIQUE_ID_BYTES}-byte NCCL unique id",
            shared.data.len()
        ))
    })
}

/// Joins `group`'s communicator on CUDA device `ordinal`: group rank 0 makes the unique id and
/// shares it, through the rendezvous store in a multi-process world or by a host broadcast over
/// the group when its ranks are threads of one process; the ranks meet (within the deadline)
/// before joining, since joining waits for every rank without a deadline of its own.
fn join_group(group: &ProcessGroup, ordinal: usize) -> Result<NcclComm, CommError> {
    // Every rank first finds the driver and the library, so that none waits on a rank that fails.
    check_cuda_driver()?;
    NcclLibrary::get()?;
    let id = agree_unique_id(group)?;
    let member = NcclMember {
        group: group.describe(),
        rank: group.rank(),
        size: group.size(),
        ordinal,
        timeout: group.options().timeout,
    };
    NcclComm::join(member, id)
}

/// Runs `f` with this group's NCCL communicator on `device`, creating it on first use.
fn with_comm<T>(
    group: &ProcessGroup,
    device: &CudaDevice,
    f: impl FnOnce(&mut NcclComm) -> Result<T, CommError>,
) -> Result<T, CommError> {
    let mut slot = group.inner.nccl.lock().unwrap_or_else(|e| e.into_inner());
    let created =
        slot.get_or_insert_with(|| join_group(group, device.index).map_err(|e| e.to_string()));
    let comm = created.as_mut().map_err(|first| {
        CommError::Nccl(format!(
            "{} has no NCCL communicator: creating it failed ({first})",
            group.describe()
        ))
    })?;
    if comm.ordinal() != device.index {
        return Err(CommError::Nccl(format!(
            "{} has its NCCL communicator on CUDA device {}, but this tensor is on device {}",
            group.describe(),
            comm.ordinal(),
            device.index
        )));
    }
    f(comm)
}

type Client = ComputeClient<CudaRuntime>;

fn device_ptr(client: &Client, handle: &Handle) -> Result<u64, CommError> {
    let resource = client
        .get_resource(handle.clone())
        .map_err(|e| cuda_error("resolving a device buffer", e))?;
    Ok(resource.resource().ptr)
}

/// Waits until every kernel CubeCL queued on this device has finished (see the module doc).
fn sync_cubecl(client: &Client) -> Result<(), CommError> {
    block_on(client.sync()).map_err(|e| cuda_error("waiting for CubeCL's queue", e))
}

/// A new output buffer of `out_bytes` bytes, after `call(comm, input pointer, output pointer)`
/// ran on it: with CubeCL's queue drained first, or, on CubeCL's stream, in its queue order
/// (see the module doc). NCCL never touches a buffer of no bytes, so an empty input lends the
/// output's pointer, and an empty output still gets a byte (CubeCL does not promise a device
/// address for an empty allocation).
fn run_on_buffers(
    comm: &mut NcclComm,
    input: &CudaTensor,
    out_bytes: usize,
    call: impl FnOnce(&mut NcclComm, u64, u64) -> Result<(), CommError> + Send,
) -> Result<Handle, CommError> {
    let output = input.client.empty(out_bytes.max(1));
    let empty_input = input.handle.size() == 0;
    if on_cubecl_stream() {
        let handles = [output.clone(), input.handle.clone()];
        let handles = if empty_input {
            &handles[..1]
        } else {
            &handles[..]
        };
        crate::cuda::stream::enqueue(&input.device, handles, |stream, pointers| {
            let (output_ptr, input_ptr) = (pointers[0], *pointers.last().unwrap());
            comm.on_stream(stream as RawStream, |comm| {
                call(comm, input_ptr, output_ptr)
            })
        })
        .map_err(CommError::Nccl)?;
        return Ok(output);
    }
    let output_ptr = device_ptr(&input.client, &output)?;
    let input_ptr = if empty_input {
        output_ptr
    } else {
        device_ptr(&input.client, &input.handle)?
    };
    sync_cubecl(&input.client)?;
    call(comm, input_ptr, output_ptr)?;
    Ok(output)
}

fn element_count(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// `dim` moved to the front: the permutation, and its inverse.
fn front_axes(rank: usize, dim: usize) -> (Vec<usize>, Vec<usize>) {
    let forward: Vec<usize> = std::iter::once(dim)
        .chain((0..rank).filter(|&d| d != dim))
        .collect();
    let mut inverse = vec![0; rank];
    for (position, &axis) in forward.iter().enumerate() {
        inverse[axis] = position;
    }
    (forward, inverse)
}

/// Runs `op` over `group` on the device when `primitive` holds a CUDA tensor (see
/// [`into_cuda`]); otherwise gives the primitive back for the host path.
pub(crate) fn try_collective<P: 'static, B: Backend>(
    group: &ProcessGroup,
    primitive: P,
    op: DeviceOp,
) -> Result<Result<P, CommError>, P> {
    let tensor = into_cuda::<P, B>(primitive)?;
    if op.is_integer_mean(&tensor) {
        // ncclAvg is defined for floating-point types only; the host path truncates as
        // documented on `ReduceOp::Mean`. Every rank has the same dtype, so all go there.
        return Err(from_cuda::<P, B>(tensor));
    }
    Ok(collective(group, tensor, op).map(from_cuda::<P, B>))
}

/// Runs `op` on a CUDA tensor over `group`.
fn collective(
    group: &ProcessGroup,
    tensor: CudaTensor,
    op: DeviceOp,
) -> Result<CudaTensor, CommError> {
    let kind = op.kind();
    let dtype = wire_dtype(kind, &tensor)?;
    let shape = tensor.shape().to_vec();
    if let DeviceOp::AllGather(dim) | DeviceOp::ReduceScatter(dim, _) = op {
        group.check_dim(kind, &shape, dim)?;
    }
    if let DeviceOp::Broadcast(root) = op
        && root >= group.size()
    {
        return Err(group.invalid(
            kind,
            format!(
                "root {root} is not a rank of the group (size {})",
                group.size()
            ),
        ));
    }
    let ctx = group.begin(kind, dtype, &shape, op.arg())?;
    if group.size() == 1 {
        return Ok(tensor);
    }
    let device = tensor.device.clone();
    let types = (nccl_dtype(dtype), dtype.size());
    match op {
        DeviceOp::AllReduce(reduce) => with_comm(group, &device, |comm| {
            flat(comm, tensor, |comm, input, out, count| {
                // SAFETY: both buffers hold `count` elements, written before the call runs
                // (CubeCL's queue drained, or the call ordered after it on its stream).
                unsafe { comm.all_reduce(input, out, count, types.0, nccl_op(reduce)) }
            })
        }),
        DeviceOp::Broadcast(root) => with_comm(group, &device, |comm| {
            flat(comm, tensor, |comm, input, out, count| {
                // SAFETY: as above.
                unsafe { comm.broadcast(input, out, count, types.0, root) }
            })
        }),
        DeviceOp::AllGather(dim) => {
            // Shapes travel as message descriptors; the payloads are empty.
            let peers = peers_of(group);
            ctx.send_each(&peers, 0, |_| Payload::empty())?;
            let mut rows = Vec::with_capacity(group.size());
            for (message, &q) in ctx.recv_all(&peers, 0)?.iter().zip(&peers) {
                rows.push(ctx.gathered_size(q, &message.desc.shape, &shape, dim)?);
            }
            rows.insert(group.rank(), shape[dim]);
            with_comm(group, &device, |comm| {
                along_dim(
                    comm,
                    tensor,
                    dim,
                    rows.iter().sum(),
                    |comm, input, out, inner| {
                        let counts: Vec<usize> = rows.iter().map(|r| r * inner).collect();
                        // SAFETY: `input` holds counts[rank] elements, `out` their sum.
                        unsafe { gather_counts(comm, input, out, &counts, types) }
                    },
                )
            })
        }
        DeviceOp::ReduceScatter(dim, reduce) => {
            let rows = split_sizes(shape[dim], group.size());
            with_comm(group, &device, |comm| {
                along_dim(
                    comm,
                    tensor,
                    dim,
                    rows[group.rank()],
                    |comm, input, out, inner| {
                        let counts: Vec<usize> = rows.iter().map(|r| r * inner).collect();
                        // SAFETY: `input` holds the sum of counts, `out` counts[rank] elements.
                        unsafe { scatter_counts(comm, input, out, &counts, types, nccl_op(reduce)) }
                    },
                )
            })
        }
    }
}

/// All-gather of `counts[q]` elements from each rank q: `ncclAllGather` when they are equal.
///
/// # Safety
/// As [`NcclComm::all_gather_v`].
unsafe fn gather_counts(
    comm: &mut NcclComm,
    input: u64,
    out: u64,
    counts: &[usize],
    types: (c_int, usize),
) -> Result<(), CommError> {
    // SAFETY: forwarded from the caller.
    unsafe {
        if counts.iter().all(|&c| c == counts[0]) {
            comm.all_gather(input, out, counts[0], types.0)
        } else {
            comm.all_gather_v(input, out, counts, types)
        }
    }
}

/// Reduce-scatter into blocks of `counts[q]` elements: `ncclReduceScatter` when they are equal.
///
/// # Safety
/// As [`NcclComm::reduce_scatter_v`].
unsafe fn scatter_counts(
    comm: &mut NcclComm,
    input: u64,
    out: u64,
    counts: &[usize],
    types: (c_int, usize),
    op: c_int,
) -> Result<(), CommError> {
    // SAFETY: forwarded from the caller.
    unsafe {
        if counts.iter().all(|&c| c == counts[0]) {
            comm.reduce_scatter(input, out, counts[0], types.0, op)
        } else {
            comm.reduce_scatter_v(input, out, counts, types, op)
        }
    }
}

/// Runs `nccl(comm, input, output, count)` where the output has the input's shape.
fn flat(
    comm: &mut NcclComm,
    tensor: CudaTensor,
    nccl: impl FnOnce(&mut NcclComm, u64, u64, usize) -> Result<(), CommError> + Send,
) -> Result<CudaTensor, CommError> {
    let input = into_contiguous(tensor);
    let shape = input.shape();
    let count = shape.num_elements();
    let out_bytes = count * input.dtype.size();
    let output = run_on_buffers(comm, &input, out_bytes, |comm, input_ptr, output_ptr| {
        nccl(comm, input_ptr, output_ptr, count)
    })?;
    Ok(CubeTensor::new_contiguous(
        input.client.clone(),
        input.device.clone(),
        shape,
        output,
        input.dtype,
    ))
}

/// Runs `nccl(comm, input, output, inner)` on the tensor with `dim` moved to the front and made
/// contiguous, where the output has `out_rows` rows of `inner` elements along `dim`; the result
/// has `dim` back in place.
fn along_dim(
    comm: &mut NcclComm,
    tensor: CudaTensor,
    dim: usize,
    out_rows: usize,
    nccl: impl FnOnce(&mut NcclComm, u64, u64, usize) -> Result<(), CommError> + Send,
) -> Result<CudaTensor, CommError> {
    let (to_front, back) = front_axes(tensor.shape().num_dims(), dim);
    let input = into_contiguous(permute(tensor, &to_front));
    let mut dims = input.shape().to_vec();
    let inner = element_count(&dims[1..]);
    dims[0] = out_rows;
    let out_bytes = out_rows * inner * input.dtype.size();
    let output = run_on_buffers(comm, &input, out_bytes, |comm, input_ptr, output_ptr| {
        nccl(comm, input_ptr, output_ptr, inner)
    })?;
    let gathered = CubeTensor::new_contiguous(
        input.client.clone(),
        input.device.clone(),
        Shape::from(dims),
        output,
        input.dtype,
    );
    Ok(permute(gathered, &back))
}

impl DeviceOp {
    fn is_integer_mean(self, tensor: &CudaTensor) -> bool {
        let mean = matches!(
            self,
            DeviceOp::AllReduce(ReduceOp::Mean) | DeviceOp::ReduceScatter(_, ReduceOp::Mean)
        );
        mean && !tensor.dtype.is_float()
    }

    fn kind(self) -> OpKind {
        match self {
            DeviceOp::AllReduce(_) => OpKind::AllReduce,
            DeviceOp::AllGather(_) => OpKind::AllGather,
            DeviceOp::ReduceScatter(..) => OpKind::ReduceScatter,
            DeviceOp::Broadcast(_) => OpKind::Broadcast,
        }
    }

    /// The argument the debug-mode agreement check compares: the host collectives' argument,
    /// with the top bit set, so a rank on NCCL and a rank on the host path disagree visibly.
    fn arg(self) -> u64 {
        const ON_DEVICE: u64 = 1 << 63;
        ON_DEVICE
            | match self {
                DeviceOp::AllReduce(op) => op.code(),
                DeviceOp::AllGather(dim) => dim as u64,
                DeviceOp::ReduceScatter(dim, op) => op.code() | (dim as u64) << 8,
                DeviceOp::Broadcast(root) => root as u64,
            }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn front_axes_invert() {
        for rank in 1..5 {
            for dim in 0..rank {
                let (forward, inverse) = front_axes(rank, dim);
                assert_eq!(forward[0], dim);
                let round_trip: Vec<usize> = inverse.iter().map(|&i| forward[i]).collect();
                assert_eq!(round_trip, (0..rank).collect::<Vec<_>>());
            }
        }
    }
}
