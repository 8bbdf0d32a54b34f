//! The CubeCL kernels: `silu(g) ∘ u` forward and `[dg, du]` backward, one unit per element,
//! computed in f32 and written in the inputs' type.

use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::kernels::cube_kernel::{CubeKernel, TensorSpec, unsupported_elementwise};
use crate::kernels::launch::{accepted, elementwise_grid, empty_like};

/// `σ(g) = 1 / (1 + e^−g)`.
#[cube]
fn sigmoid(gate: f32) -> f32 {
    1.0f32 / (1.0f32 + (-gate).exp())
}

/// One unit per element: `out[i] = F(silu(g[i])·u[i])`.
#[cube(launch_unchecked)]
fn forward_elementwise<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    out: &mut Tensor<F>,
    #[define(F)] _dtype: StorageType,
) {
    let index = ABSOLUTE_POS;
    if index < out.len() {
        let g = f32::cast_from(gate[index]);
        out[index] = F::cast_from(g * sigmoid(g) * f32::cast_from(up[index]));
    }
}

/// One unit per element: `dg[i] = F(dy·u·σ(g)(1 + g(1 − σ(g))))`, `du[i] = F(dy·silu(g))`.
#[cube(launch_unchecked)]
fn backward_elementwise<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    output_grad: &Tensor<F>,
    gate_grad: &mut Tensor<F>,
    up_grad: &mut Tensor<F>,
    #[define(F)] _dtype: StorageType,
) {
    let index = ABSOLUTE_POS;
    if index < gate_grad.len() {
        let g = f32::cast_from(gate[index]);
        let u = f32::cast_from(up[index]);
        let dy = f32::cast_from(output_grad[index]);
        let s = sigmoid(g);
        gate_grad[index] = F::cast_from(dy * u * (s * (1.0f32 + g * (1.0f32 - s))));
        up_grad[index] = F::cast_from(dy * (g * s));
    }
}

/// The inputs, contiguous, once they are ones the kernels take ([`unsupported_elementwise`]); or why not.
fn checked<R: CubeRuntime, const N: usize>(
    inputs: [CubeTensor<R>; N],
) -> Result<[CubeTensor<R>; N], String> {
    unsupported_elementwise::<R>(&inputs.each_ref().map(TensorSpec::of), &inputs[0].device)?;
    Ok(inputs.map(into_contiguous))
}

/// The forward kernel on `gate` and `up` (one shape and type): `silu(g) ∘ u` in their type; or
/// why it does not take them.
pub fn forward_kernel<R: CubeRuntime>(
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
) -> Result<CubeTensor<R>, String> {
    let [gate, up] = checked([gate, up])?;
    let out = empty_like(&gate);
    let client = gate.client.clone();
    let (cubes, cube_dim) = elementwise_grid(&out);
    let dtype = gate.dtype.into();
    // SAFETY: the three tensors are contiguous with one shape (checked), and the kernel
    // touches only indices below `out.len()`.
    unsafe {
        forward_elementwise::launch_unchecked(
            &client,
            cubes,
            cube_dim,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            dtype,
        )
    };
    Ok(out)
}

/// The backward kernel on `gate`, `up` and `output_grad` (one shape and type): `[dg, du]` in
/// their type; or why it does not take them.
pub fn backward_kernel<R: CubeRuntime>(
    gate: CubeTensor<R>,
    up: CubeTensor<R>,
    output_grad: CubeTensor<R>,
) -> Result<[CubeTensor<R>; 2], String> {
    let [gate, up, output_grad] = checked([gate, up, output_grad])?;
    let (gate_grad, up_grad) = (empty_like(&gate), empty_like(&gate));
    let client = gate.client.clone();
    let (cubes, cube_dim) = elementwise_grid(&gate_grad);
    let dtype = gate.dtype.into();
    // SAFETY: the five tensors are contiguous with one shape (checked), and the kernel touches
    // only indices below their length.
    unsafe {
        backward_elementwise::launch_unchecked(
            &client,
            cubes,
            cube_dim,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            output_grad.into_tensor_arg(),
            gate_grad.clone().into_tensor_arg(),
            up_grad.clone().into_tensor_arg(),
            dtype,
        )
    };
    Ok([gate_grad, up_grad])
}

/// [`forward_kernel`] for the router.
#[derive(Clone, Debug)]
pub(super) struct Forward;

impl CubeKernel<2, 1> for Forward {
    fn op(&self) -> &'static str {
        "swiglu forward"
    }

    fn outputs<R: CubeRuntime>(
        &self,
        inputs: &[TensorSpec; 2],
        device: &R::Device,
    ) -> Result<[TensorSpec; 1], String> {
        unsupported_elementwise::<R>(inputs, device)?;
        Ok([inputs[0].clone()])
    }

    fn launch<R: CubeRuntime>(&self, [gate, up]: [CubeTensor<R>; 2]) -> [CubeTensor<R>; 1] {
        [accepted(self.op(), forward_kernel(gate, up))]
    }
}

/// [`backward_kernel`] for the router.
#[derive(Clone, Debug)]
pub(super) struct Backward;

impl CubeKernel<3, 2> for Backward {
    fn op(&self) -> &'static str {
        "swiglu backward"
    }

    fn outputs<R: CubeRuntime>(
        &self,
        inputs: &[TensorSpec; 3],
        device: &R::Device,
    ) -> Result<[TensorSpec; 2], String> {
        unsupported_elementwise::<R>(inputs, device)?;
        Ok([inputs[0].clone(), inputs[0].clone()])
    }

    fn launch<R: CubeRuntime>(
        &self,
        [gate, up, output_grad]: [CubeTensor<R>; 3],
    ) -> [CubeTensor<R>; 2] {
        accepted(self.op(), backward_kernel(gate, up, output_grad))
    }
}
