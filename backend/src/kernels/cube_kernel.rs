//! What a CubeCL kernel is to the router ([`super::route`]): a check of its inputs' shapes and
//! types that says what it gives (or why it declines them) before anything runs, and a launch on
//! inputs it took. The check comes first because under Burn's fusion a kernel is queued, not
//! run, and a queued operation cannot decline when its turn comes ([`crate::fusion`]).

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

/// A tensor's shape and type: what a kernel's acceptance check reads.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub shape: Shape,
    pub dtype: DType,
}

impl TensorSpec {
    /// The shape and type of `tensor`, any backend's primitive.
    pub fn of(tensor: &impl TensorMetadata) -> Self {
        Self {
            shape: tensor.shape(),
            dtype: tensor.dtype(),
        }
    }

    pub fn new(shape: Shape, dtype: DType) -> Self {
        Self { shape, dtype }
    }
}

/// A kernel taking `N` tensors and giving `M`, on any CubeCL runtime.
pub(crate) trait CubeKernel<const N: usize, const M: usize>:
    Clone + std::fmt::Debug + Send + Sync + 'static
{
    /// The op's name in the log and in [`super::route::kernel_paths`] (`"attention forward"`).
    fn op(&self) -> &'static str;

    /// The outputs' shapes and types for inputs of these shapes and types on `device`, or why
    /// the kernel does not take them (the caller then runs the reference): a dtype the device
    /// lacks, a shape outside the kernel's range.
    fn outputs<R: CubeRuntime>(
        &self,
        inputs: &[TensorSpec; N],
        device: &R::Device,
    ) -> Result<[TensorSpec; M], String>;

    /// The kernel on inputs [`Self::outputs`] accepted, whatever their strides.
    fn launch<R: CubeRuntime>(&self, inputs: [CubeTensor<R>; N]) -> [CubeTensor<R>; M];
}

/// Why an elementwise kernel does not take `inputs` on `device`, if it does not: they must be of
/// one shape and type, f32, f16 or bf16 on a device that has it ([`unsupported_float`]), not
/// empty.
pub(crate) fn unsupported_elementwise<R: CubeRuntime>(
    inputs: &[TensorSpec],
    device: &R::Device,
) -> Result<(), String> {
    let first = &inputs[0];
    unsupported_float::<R>(first.dtype, device)?;
    if let Some(other) = inputs.iter().find(|t| *t != first) {
        return Err(format!(
            "inputs {:?} {:?} and {:?} {:?}",
            first.shape, first.dtype, other.shape, other.dtype
        ));
    }
    if first.shape.num_elements() == 0 {
        return Err("no elements".into());
    }
    Ok(())
}

/// Why a kernel does not compute in `dtype` on `device`, if it does not: a type other than
/// f32, f16 and bf16 (the kernels' float types), or one the device has no arithmetic for.
pub(crate) fn unsupported_float<R: CubeRuntime>(
    dtype: DType,
    device: &R::Device,
) -> Result<(), String> {
    if ![DType::F32, DType::F16, DType::BF16].contains(&dtype) {
        return Err(format!("dtype {dtype:?} (f32, f16 and bf16 are supported)"));
    }
    if !R::client(device).properties().supports_type(dtype) {
        return Err(format!("the device has no {dtype:?} arithmetic"));
    }
    Ok(())
}
