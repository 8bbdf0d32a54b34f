//! wildfire on Burn's fusion backend (`Fusion<CubeBackend<R, …>>`, what `--device wgpu` and
//! `--device cuda` train on): a fused backend's tensor is a handle into a queue of operations
//! that Burn's fusers merge into fewer kernels, not a device buffer. Code that needs the buffer
//! meets that queue here, and only here:
//!
//! - **our kernels enter the queue as custom operations** ([`queue_kernel`]): the kernel's
//!   acceptance check runs first, on the inputs' shapes and types, and only an accepted call is
//!   queued, declaring its outputs' shapes and types; when the queue reaches it, its inputs are
//!   resolved to CubeCL tensors and it launches. Fusion ends its blocks around such an
//!   operation, so only the big ops are worth one. This is how burn-vision queues its own
//!   kernels under fusion.
//! - **collectives resolve their tensors** ([`resolve`]), which runs the queue up to the tensor
//!   (on the host's side; the device keeps running), and hand their results back to the queue
//!   as new tensors ([`adopt`]). They cannot be queued: they must return errors and keep their
//!   deadlines, which a queued operation cannot.
//! - **f64 stays out of the queue**: Burn's fusers have no f64 (burn-cubecl-fusion 0.21 panics
//!   with "Unsupported precision for fusion: f64"), so code that would compute in f64 asks
//!   [`is_fused_backend`] first.

use std::any::TypeId;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape};
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{FusionTensor, NoOp};
use burn_ir::OperationOutput;
use burn_ir::{CustomOpIr, HandleContainer, InitOperationIr, OperationIr, TensorIr};

use crate::kernels::cube_kernel::{CubeKernel, TensorSpec};

/// A tensor of Burn's fusion backend over CubeCL runtime `R`.
pub type FusedTensor<R> = FusionTensor<FusionCubeRuntime<R>>;

/// Whether `B`'s float tensors are those of Burn's fusion backend over a CubeCL runtime
/// ([`crate::device::FusedWgpu`], [`crate::device::FusedCuda`], alone or inside `Parallel<_>`),
/// whose stream must not see f64 (see the module doc).
pub fn is_fused_backend<B: Backend>() -> bool {
    let primitive = TypeId::of::<B::FloatTensorPrimitive>();
    #[cfg(feature = "wgpu")]
    if primitive == TypeId::of::<FusedTensor<cubecl::wgpu::WgpuRuntime>>() {
        return true;
    }
    #[cfg(feature = "cuda")]
    if primitive == TypeId::of::<FusedTensor<cubecl::cuda::CudaRuntime>>() {
        return true;
    }
    let _ = primitive;
    false
}

/// The CubeCL backend whose handles a fused tensor over runtime `R` resolves to. The float,
/// int and bool element types do not matter here: a handle becomes a `CubeTensor<R>` of the
/// handle's own type whatever they are.
type Unfused<R> = CubeBackend<R, f32, i32, u8>;

/// Queues `kernel` on `inputs` as one custom operation of their fusion stream, with outputs of
/// `outputs`' shapes and types (what [`CubeKernel::outputs`] accepted for these inputs); the
/// outputs, as fused tensors.
pub(crate) fn queue_kernel<R, K, const N: usize, const M: usize>(
    kernel: K,
    inputs: [FusedTensor<R>; N],
    outputs: [TensorSpec; M],
) -> [FusedTensor<R>; M]
where
    R: CubeRuntime,
    K: CubeKernel<N, M>,
{
    let client = inputs[0].client.clone();
    let streams = OperationStreams::with_inputs(&inputs);
    let outputs =
        outputs.map(|spec| TensorIr::uninit(client.create_empty_handle(), spec.shape, spec.dtype));
    let inputs = inputs.map(FusionTensor::into_ir);
    let desc = CustomOpIr::new(kernel.op(), &inputs, &outputs);
    let queued = QueuedKernel::<R, K, N, M> {
        desc: desc.clone(),
        kernel,
        runtime: std::marker::PhantomData,
    };
    let tensors = client.register(streams, OperationIr::Custom(desc), queued);
    tensors.try_into().unwrap_or_else(|tensors: Vec<_>| {
        unreachable!("{} outputs registered for {M}", tensors.len())
    })
}

/// A kernel waiting in the fusion queue, with the description of its inputs and outputs.
struct QueuedKernel<R, K, const N: usize, const M: usize> {
    desc: CustomOpIr,
    kernel: K,
    runtime: std::marker::PhantomData<fn() -> R>,
}

impl<R, K: std::fmt::Debug, const N: usize, const M: usize> std::fmt::Debug
    for QueuedKernel<R, K, N, M>
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuedKernel")
            .field("kernel", &self.kernel)
            .field("desc", &self.desc)
            .finish()
    }
}

impl<R, K, const N: usize, const M: usize> Operation<FusionCubeRuntime<R>>
    for QueuedKernel<R, K, N, M>
where
    R: CubeRuntime,
    K: CubeKernel<N, M>,
{
    fn execute(
        &self,
        handles: &mut HandleContainer<
            <FusionCubeRuntime<R> as burn_fusion::FusionRuntime>::FusionHandle,
        >,
    ) {
        let (inputs, outputs) = self.desc.as_fixed::<N, M>();
        let tensors = inputs
            .each_ref()
            .map(|input| handles.get_float_tensor::<Unfused<R>>(input));
        let results = self.kernel.launch(tensors);
        for (output, result) in outputs.iter().zip(results) {
            handles.register_float_tensor::<Unfused<R>>(&output.id, result);
        }
    }
}

/// The CubeCL tensor behind `tensor`, once its fusion stream has run up to it (a host-side
/// wait for the queue, not for the device).
pub fn resolve<R: CubeRuntime>(tensor: FusedTensor<R>) -> CubeTensor<R> {
    let client = tensor.client.clone();
    // A float, int or bool handle resolves alike (`Unfused`'s handles carry their own type).
    client.resolve_tensor_float::<Unfused<R>>(tensor)
}

/// `tensor` as a new tensor of its device's fusion stream.
pub fn adopt<R: CubeRuntime>(tensor: CubeTensor<R>) -> FusedTensor<R> {
    let client = burn_fusion::get_client::<Unfused<R>>(&tensor.device);
    let (shape, dtype): (Shape, DType) = (tensor.meta.shape().clone(), tensor.dtype);
    let handle = tensor.into();
    let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            OperationStreams::default(),
            OperationIr::Init(desc),
            NoOp::<Unfused<R>>::new(),
        )
        .output()
}
