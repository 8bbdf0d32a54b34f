//! The CubeCL kernels: the forward is the epilogue kernel the mixed-precision matmul also runs
//! after its product; the backward computes `dy ∘ g'(x + b)` in f32 in one pass.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::kernels::cube_kernel::{CubeKernel, TensorSpec, unsupported_float};
use crate::kernels::launch::{accepted, elementwise_grid, empty_on};

/// GELU's `c`, `a` and exponent clamp in f32 (see the module doc).
const C: f32 = super::GELU_C as f32;
const A: f32 = super::GELU_A as f32;
const CLAMP: f32 = super::GELU_EXPONENT_CLAMP as f32;

/// GELU's exponent `E = −2c(z + a·z³)`.
#[cube]
fn exponent(z: f32) -> f32 {
    -2.0f32 * f32::new(C) * (z + f32::new(A) * z * z * z)
}

/// GPT-2's GELU in f32, `z / (1 + e^min(E, 80))` (the form of `gelu_tanh_f32`).
#[cube]
fn gelu(z: f32) -> f32 {
    z / (1.0f32 + min(exponent(z), f32::new(CLAMP)).exp())
}

/// `g'(z)` of the clamped form (see the module doc).
#[cube]
fn gelu_slope(z: f32) -> f32 {
    let e = exponent(z);
    let s = 1.0f32 / (1.0f32 + min(e, f32::new(CLAMP)).exp());
    let mut slope = s;
    if e < f32::new(CLAMP) {
        let growth = 1.0f32 + 3.0f32 * f32::new(A) * z * z;
        slope += z * s * (1.0f32 - s) * 2.0f32 * f32::new(C) * growth;
    }
    slope
}

/// One unit per element of `input: [.., columns]`:
/// `out[i] = O(g(input[i] + bias[i mod columns]))`, the bias and `g` (GELU) each optional.
#[cube(launch_unchecked)]
fn epilogue_kernel<I: Float, O: Float>(
    input: &Tensor<I>,
    bias: &Tensor<f32>,
    out: &mut Tensor<O>,
    columns: usize,
    #[comptime] has_bias: bool,
    #[comptime] apply_gelu: bool,
    #[define(I, O)] _dtypes: [StorageType; 2],
) {
    let index = ABSOLUTE_POS;
    if index < out.len() {
        let mut value = f32::cast_from(input[index]);
        if has_bias {
            value += bias[index % columns];
        }
        if apply_gelu {
            value = gelu(value);
        }
        out[index] = O::cast_from(value);
    }
}

/// One unit per element: `grad[i] = dy[i]·g'(x[i] + bias[i mod columns])`, in f32.
#[cube(launch_unchecked)]
fn bias_gelu_grad_kernel<F: Float>(
    x: &Tensor<F>,
    bias: &Tensor<f32>,
    output_grad: &Tensor<F>,
    grad: &mut Tensor<f32>,
    columns: usize,
    #[define(F)] _dtype: StorageType,
) {
    let index = ABSOLUTE_POS;
    if index < grad.len() {
        let z = f32::cast_from(x[index]) + bias[index % columns];
        grad[index] = f32::cast_from(output_grad[index]) * gelu_slope(z);
    }
}

/// [`epilogue_kernel`] on `input` (`[.., columns]`, any kernel float type): the bias added
/// when there is one, then GELU when `gelu`, written in `output`'s type.
pub(crate) fn epilogue<R: CubeRuntime>(
    input: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    columns: usize,
    gelu: bool,
    output: DType,
) -> CubeTensor<R> {
    let input = into_contiguous(input);
    let has_bias = bias.is_some();
    // Without a bias the kernel reads none; one element stands in for the binding.
    let bias = match bias {
        Some(bias) => into_contiguous(cast(bias, DType::F32)),
        None => empty_on(&input, Shape::new([1]), DType::F32),
    };
    let out = empty_on(&input, input.meta.shape().clone(), output);
    let client = input.client.clone();
    let (cubes, cube_dim) = elementwise_grid(&out);
    let dtypes = [input.dtype.into(), output.into()];
    // SAFETY: `input` and `out` are contiguous with the same shape, the kernel writes only
    // indices below `out.len()`, and reads `bias` (of `columns` elements, checked by the
    // callers) modulo `columns` only when there is one.
    unsafe {
        epilogue_kernel::launch_unchecked(
            &client,
            cubes,
            cube_dim,
            input.into_tensor_arg(),
            bias.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            columns,
            has_bias,
            gelu,
            dtypes,
        )
    };
    out
}

/// The forward kernel on `x: [.., columns]` and `bias: [columns]`: `g(x + b)` in `x`'s
/// type; or why it does not take them (a dtype outside f32, f16 and bf16 or one the device
/// lacks, mismatched shapes).
pub fn forward_kernel<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: CubeTensor<R>,
) -> Result<CubeTensor<R>, String> {
    let columns =
        checked_columns::<R>(&TensorSpec::of(&x), &TensorSpec::of(&bias), None, &x.device)?;
    let dtype = x.dtype;
    Ok(epilogue(x, Some(bias), columns, true, dtype))
}

/// The backward kernel ([`bias_gelu_grad_kernel`]) on `x: [.., columns]`,
/// `bias: [columns]` and `output_grad` (`x`'s shape and type): `dy ∘ g'(x + b)` in f32; or
/// why it does not take them.
pub fn backward_kernel<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: CubeTensor<R>,
    output_grad: CubeTensor<R>,
) -> Result<CubeTensor<R>, String> {
    let specs = [&x, &bias, &output_grad].map(TensorSpec::of);
    let columns = checked_columns::<R>(&specs[0], &specs[1], Some(&specs[2]), &x.device)?;
    let [x, output_grad] = [x, output_grad].map(into_contiguous);
    let bias = into_contiguous(cast(bias, DType::F32));
    let grad = empty_on(&x, x.meta.shape().clone(), DType::F32);
    let client = x.client.clone();
    let (cubes, cube_dim) = elementwise_grid(&grad);
    let dtype = x.dtype.into();
    // SAFETY: `x`, `output_grad` and `grad` are contiguous with the same shape (checked by
    // `checked_columns`), the kernel touches only indices below `grad.len()`, and reads
    // `bias` (of `columns` elements) modulo `columns`.
    unsafe {
        bias_gelu_grad_kernel::launch_unchecked(
            &client,
            cubes,
            cube_dim,
            x.into_tensor_arg(),
            bias.into_tensor_arg(),
            output_grad.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            columns,
            dtype,
        )
    };
    Ok(grad)
}

/// The columns of `x: [.., columns]` once `x`, `bias: [columns]` and any `like_x` (of `x`'s
/// shape and type) are ones the kernels take on `device`; or why they are not.
fn checked_columns<R: CubeRuntime>(
    x: &TensorSpec,
    bias: &TensorSpec,
    like_x: Option<&TensorSpec>,
    device: &R::Device,
) -> Result<usize, String> {
    for dtype in [x.dtype, bias.dtype] {
        unsupported_float::<R>(dtype, device)?;
    }
    let (shape, bias_shape) = (&x.shape, &bias.shape);
    let columns = shape
        .num_dims()
        .checked_sub(1)
        .map_or(0, |last| shape[last]);
    if bias_shape.num_dims() != 1 || bias_shape[0] != columns || shape.num_elements() == 0 {
        return Err(format!("input {shape:?} with bias {bias_shape:?}"));
    }
    if let Some(other) = like_x
        && other != x
    {
        return Err(format!(
            "gradient {:?} {:?} for input {shape:?} {:?}",
            other.shape, other.dtype, x.dtype
        ));
    }
    Ok(columns)
}

/// [`forward_kernel`] for the router.
#[derive(Clone, Debug)]
pub(super) struct Forward;

impl CubeKernel<2, 1> for Forward {
    fn op(&self) -> &'static str {
        "bias_gelu forward"
    }

    fn outputs<R: CubeRuntime>(
        &self,
        [x, bias]: &[TensorSpec; 2],
        device: &R::Device,
    ) -> Result<[TensorSpec; 1], String> {
        checked_columns::<R>(x, bias, None, device)?;
        Ok([x.clone()])
    }

    fn launch<R: CubeRuntime>(&self, [x, bias]: [CubeTensor<R>; 2]) -> [CubeTensor<R>; 1] {
        [accepted(self.op(), forward_kernel(x, bias))]
    }
}

/// [`backward_kernel`] for the router.
#[derive(Clone, Debug)]
pub(super) struct Backward;

impl CubeKernel<3, 1> for Backward {
    fn op(&self) -> &'static str {
        "bias_gelu backward"
    }

    fn outputs<R: CubeRuntime>(
        &self,
        [x, bias, output_grad]: &[TensorSpec; 3],
        device: &R::Device,
    ) -> Result<[TensorSpec; 1], String> {
        checked_columns::<R>(x, bias, Some(output_grad), device)?;
        Ok([TensorSpec::new(x.shape.clone(), DType::F32)])
    }

    fn launch<R: CubeRuntime>(
        &self,
        [x, bias, output_grad]: [CubeTensor<R>; 3],
    ) -> [CubeTensor<R>; 1] {
        [accepted(self.op(), backward_kernel(x, bias, output_grad))]
    }
}
