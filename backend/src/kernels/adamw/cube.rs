//! The CubeCL kernel: AdamW's step on one f32 parameter tensor (or one flat bucket of them) as
//! one elementwise pass, one unit per element, with the arithmetic of the parent module in the
//! same order. It writes new buffers for `θ`, `m` and `v` (a queued kernel in Burn's fusion
//! stream cannot write into its inputs' memory).
//!
//! A GPU compiler may contract `a·b + c` into one fused multiply-add and WGSL allows `√` and
//! `/` a few ulps of error, so on a GPU the step is within a few f32 ulps of Burn's op-by-op
//! step rather than bitwise it; every rank and every ZeRO stage runs this same kernel, so the
//! stages still agree bitwise with each other.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::StepScalars;
use crate::kernels::cube_kernel::{CubeKernel, TensorSpec, unsupported_elementwise};
use crate::kernels::launch::{accepted, elementwise_grid, empty_like};

/// One unit per element: `m ← β₁m + (1 − β₁)g`, `v ← β₂v + (1 − β₂)g²`,
/// `θ ← θ·keep − η·(m/c₁)/(√(v/c₂) + ε)` (`keep = 1 − ηλ`, or exactly 1 without decay).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)] // the step's nine scalars
fn adamw_step<F: Float>(
    param: &Tensor<F>,
    grad: &Tensor<F>,
    moment_1: &Tensor<F>,
    moment_2: &Tensor<F>,
    param_out: &mut Tensor<F>,
    moment_1_out: &mut Tensor<F>,
    moment_2_out: &mut Tensor<F>,
    beta_1: f32,
    beta_2: f32,
    gain_1: f32,
    gain_2: f32,
    correction_1: f32,
    correction_2: f32,
    epsilon: f32,
    keep: f32,
    lr: f32,
    #[define(F)] _dtype: StorageType,
) {
    let index = ABSOLUTE_POS;
    if index < param_out.len() {
        let g = f32::cast_from(grad[index]);
        let m = f32::cast_from(moment_1[index]) * beta_1 + g * gain_1;
        let v = f32::cast_from(moment_2[index]) * beta_2 + (g * g) * gain_2;
        let corrected_1 = m / correction_1;
        let corrected_2 = v / correction_2;
        let delta = corrected_1 / (corrected_2.sqrt() + epsilon);
        let decayed = f32::cast_from(param[index]) * keep;
        param_out[index] = F::cast_from(decayed - delta * lr);
        moment_1_out[index] = F::cast_from(m);
        moment_2_out[index] = F::cast_from(v);
    }
}

/// Why the kernel does not take `[θ, g, m, v]` of these shapes and types on `device`, if it
/// does not: one shape, all f32 (the moments are f32 and the arithmetic is Burn's f32 step), not
/// empty.
fn unsupported<R: CubeRuntime>(inputs: &[TensorSpec; 4], device: &R::Device) -> Result<(), String> {
    if inputs[0].dtype != DType::F32 {
        return Err(format!("dtype {:?} (the step is f32's)", inputs[0].dtype));
    }
    unsupported_elementwise::<R>(inputs, device)
}

/// The step on `[θ, g, m, v]` (one shape, f32): `[θ, m, v]` after it; or why the kernel does
/// not take them.
fn step_kernel<R: CubeRuntime>(
    inputs: [CubeTensor<R>; 4],
    scalars: &StepScalars,
) -> Result<[CubeTensor<R>; 3], String> {
    unsupported::<R>(&inputs.each_ref().map(TensorSpec::of), &inputs[0].device)?;
    let [param, grad, moment_1, moment_2] = inputs.map(into_contiguous);
    let outputs = [&param, &moment_1, &moment_2].map(empty_like);
    let client = param.client.clone();
    let (cubes, cube_dim) = elementwise_grid(&outputs[0]);
    let dtype = param.dtype.into();
    let s = scalars;
    // SAFETY: the seven tensors are contiguous with one shape (checked, or made so), and the
    // kernel touches only indices below their length.
    unsafe {
        adamw_step::launch_unchecked(
            &client,
            cubes,
            cube_dim,
            param.into_tensor_arg(),
            grad.into_tensor_arg(),
            moment_1.into_tensor_arg(),
            moment_2.into_tensor_arg(),
            outputs[0].clone().into_tensor_arg(),
            outputs[1].clone().into_tensor_arg(),
            outputs[2].clone().into_tensor_arg(),
            s.beta_1,
            s.beta_2,
            s.gain_1,
            s.gain_2,
            s.correction_1,
            s.correction_2,
            s.epsilon,
            s.keep.unwrap_or(1.0),
            s.lr,
            dtype,
        )
    };
    Ok(outputs)
}

/// [`step_kernel`] for the router, with one step's scalars.
#[derive(Clone, Debug)]
pub(super) struct Step {
    pub(super) scalars: StepScalars,
    /// Whether the kernel takes calls on CUDA, where no GPU run has verified it yet (off by
    /// default: see the parent module).
    pub(super) on_cuda: bool,
}

impl CubeKernel<4, 3> for Step {
    fn op(&self) -> &'static str {
        "adamw"
    }

    fn outputs<R: CubeRuntime>(
        &self,
        inputs: &[TensorSpec; 4],
        device: &R::Device,
    ) -> Result<[TensorSpec; 3], String> {
        if !self.on_cuda && is_cuda::<R>() {
            return Err(
                "off on CUDA until a GPU run verifies it (train.fused.adamw turns it on)".into(),
            );
        }
        unsupported::<R>(inputs, device)?;
        Ok([inputs[0].clone(), inputs[0].clone(), inputs[0].clone()])
    }

    fn launch<R: CubeRuntime>(&self, inputs: [CubeTensor<R>; 4]) -> [CubeTensor<R>; 3] {
        accepted(self.op(), step_kernel(inputs, &self.scalars))
    }
}

/// Whether `R` is CUDA's runtime.
fn is_cuda<R: CubeRuntime>() -> bool {
    use std::any::TypeId;
    #[cfg(feature = "cuda")]
    let cuda = [TypeId::of::<cubecl::cuda::CudaRuntime>()];
    #[cfg(not(feature = "cuda"))]
    let cuda: [TypeId; 0] = [];
    cuda.contains(&TypeId::of::<R>())
}
