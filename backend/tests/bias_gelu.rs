//! The fused bias + GELU (`kernels::bias_gelu`) against GPT-2's GELU and its derivative in f64:
//! the CubeCL kernels directly on wgpu (Mesa's lavapipe on CI; and CUDA in a `--features cuda`
//! build, `scripts/gpu-check.sh`), Flex's native loops and the reference in Burn ops directly,
//! and the autodiff op, forward and both gradients, on `Autodiff<Parallel<Flex>>` (the loops in
//! f32, the reference in half types) and on the kernel backends.
//!
//! Inputs are `[2, 19, 37]` (37 columns, so no row is a multiple of anything) with values in
//! [−6, 6], biases in [−1, 1], plus values where the clamp of GELU's exponent holds (−20, −1e4)
//! and where the slope is 1 (20). Tolerances, elementwise against the f64 value `e` from the
//! same (rounded) inputs: `|got − e| ≤ 2⁻¹⁷(1 + |e|)` for evaluating GELU's exp-and-quotient form
//! in f32 (an `exp` of an argument up to 80 in magnitude, correct to a few ulps of the
//! argument), plus the output type's unit roundoff times `|e|` (2⁻¹¹ for f16); the bias gradient
//! is a sum of 38 such f32 terms, allowed 38 times the bound.
//!
//! bf16 has no WGSL type, so on lavapipe the bf16 kernel cases report themselves skipped.

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Tensor, TensorPrimitive};
use wildfire_backend::Parallel;
use wildfire_backend::kernels::bias_gelu::flex;
use wildfire_backend::kernels::bias_gelu::{
    FusedBiasGeluBackend, backward_kernel, bias_gelu, forward_kernel, reference_backward,
    reference_forward,
};

use crate::common::{
    GELU_A, GELU_C, KernelBackend, compare_to_f64, gelu, has_dtype, rounded, signed_values,
    tensor_of, unit_roundoff,
};

const SHAPE: [usize; 3] = [2, 19, 37];
const ROWS: usize = SHAPE[0] * SHAPE[1];
const COLUMNS: usize = SHAPE[2];

/// GELU's derivative, `½(1 + tanh u) + ½z(1 − tanh²u)·c(1 + 3a·z²)`, in f64.
fn gelu_slope(z: f64) -> f64 {
    let t = (GELU_C * (z + GELU_A * z * z * z)).tanh();
    0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * z * z)
}

/// The inputs `x`, `bias` and output gradient `dy` (f32 values), with the clamped and saturated
/// values in the first row.
fn inputs() -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut x = signed_values(ROWS * COLUMNS, 3, 6.0);
    x[..3].copy_from_slice(&[-20.0, -1e4, 20.0]);
    (
        x,
        signed_values(COLUMNS, 5, 1.0),
        signed_values(ROWS * COLUMNS, 7, 1.0),
    )
}

/// The exact `y = g(x + b)`, `dx = dy·g'(x + b)` and `db = Σ_rows dx` from the inputs rounded to
/// `dtype` (the bias stays f32, as the GPT passes it).
fn exact(dtype: FloatDType) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (x, bias, grad) = inputs();
    let z = |i: usize| rounded(x[i], dtype) + f64::from(bias[i % COLUMNS]);
    let y = (0..x.len()).map(|i| gelu(z(i))).collect();
    let dx: Vec<f64> = (0..x.len())
        .map(|i| rounded(grad[i], dtype) * gelu_slope(z(i)))
        .collect();
    let db = (0..COLUMNS)
        .map(|j| (0..ROWS).map(|r| dx[r * COLUMNS + j]).sum())
        .collect();
    (y, dx, db)
}

/// The two passes on primitives of backend `B`, `forward(x, b)` and `backward(x, b, dy)`: the
/// forward in `dtype` (its output keeping that type), the input gradient in f32.
fn passes_match_f64<B: Backend>(
    device: &B::Device,
    dtype: FloatDType,
    forward: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
    backward: impl Fn(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) {
    let (x, bias, grad) = inputs();
    let x = tensor_of::<B, 2>(&x, [ROWS, COLUMNS], device).cast(dtype);
    let grad = tensor_of::<B, 2>(&grad, [ROWS, COLUMNS], device).cast(dtype);
    let bias = tensor_of::<B, 1>(&bias, [COLUMNS], device);
    let primitive = |t: Tensor<B, 2>| t.into_primitive().tensor();
    let bias_primitive = bias.into_primitive().tensor();
    let y = forward(primitive(x.clone()), bias_primitive.clone());
    let dx = backward(primitive(x), bias_primitive, primitive(grad));
    let y = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y));
    assert_eq!(
        y.dtype(),
        DType::from(dtype),
        "the output keeps the input's type"
    );
    let dx = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(dx));
    assert_eq!(dx.dtype(), DType::F32);
    let (exact_y, exact_dx, _) = exact(dtype);
    let what = format!("{} {dtype:?}", B::name(device));
    let mut failures = compare_to_f64(
        &format!("{what} y"),
        y.into_data(),
        &exact_y,
        unit_roundoff(dtype),
        1.0,
    );
    failures.extend(compare_to_f64(
        &format!("{what} dx"),
        dx.into_data(),
        &exact_dx,
        0.0,
        1.0,
    ));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The CubeCL kernels on primitives, in `dtype` where the device computes in it.
fn kernels_match_f64<B: KernelBackend>(dtype: FloatDType) {
    let Some(device) = B::test_device() else {
        return;
    };
    if has_dtype::<B>(&device, dtype.into()) {
        passes_match_f64::<B>(
            &device,
            dtype,
            |x, b| forward_kernel(x, b).expect("forward kernel"),
            |x, b, dy| backward_kernel(x, b, dy).expect("backward kernel"),
        );
    }
}

#[test]
fn the_kernels_match_gelu_and_its_slope_in_f64() {
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        on_kernel_backends!(kernels_match_f64(dtype));
    }
}

/// The autodiff op on backend `A`: `y`, `dx` and `db` against f64, for inputs in `dtype`.
fn autodiff_op_matches_f64<A: AutodiffBackend + FusedBiasGeluBackend>(
    device: &A::Device,
    dtype: FloatDType,
) {
    let (x, bias, grad) = inputs();
    let x = tensor_of::<A, 3>(&x, SHAPE, device)
        .cast(dtype)
        .require_grad();
    let bias = tensor_of::<A, 1>(&bias, [COLUMNS], device).require_grad();
    let grad = tensor_of::<A, 3>(&grad, SHAPE, device).cast(dtype);
    let y = bias_gelu(x.clone(), bias.clone());
    assert_eq!(y.dtype(), DType::from(dtype));
    let grads = (y.clone().cast(FloatDType::F32) * grad.cast(FloatDType::F32))
        .sum()
        .backward();
    let dx = x.grad(&grads).expect("x has a gradient");
    let db = bias.grad(&grads).expect("the bias has a gradient");
    assert_eq!(dx.dtype(), DType::from(dtype), "dx comes back in x's type");
    assert_eq!(db.dtype(), DType::F32, "db comes back in the bias's type");
    let (exact_y, exact_dx, exact_db) = exact(dtype);
    let u = unit_roundoff(dtype);
    let what = format!("{} {dtype:?}", A::name(device));
    let mut failures = compare_to_f64(&format!("{what} y"), y.into_data(), &exact_y, u, 1.0);
    failures.extend(compare_to_f64(
        &format!("{what} dx"),
        dx.into_data(),
        &exact_dx,
        u,
        1.0,
    ));
    failures.extend(compare_to_f64(
        &format!("{what} db"),
        db.into_data(),
        &exact_db,
        0.0,
        ROWS as f64,
    ));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// On `Parallel<Flex>` the op runs the native loops in f32 and the reference in half types.
#[test]
fn the_flex_op_matches_f64() {
    type A = Autodiff<Parallel<Flex>>;
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        autodiff_op_matches_f64::<A>(&Default::default(), dtype);
    }
}

/// The reference in Burn ops, in every type.
#[test]
fn the_reference_matches_f64() {
    let tensor =
        |t: FloatTensor<Flex>| Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(t));
    let bias = |t: FloatTensor<Flex>| tensor(t).reshape([COLUMNS]);
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        passes_match_f64::<Flex>(
            &Default::default(),
            dtype,
            |x, b| {
                reference_forward(tensor(x), bias(b))
                    .into_primitive()
                    .tensor()
            },
            |x, b, dy| {
                reference_backward(tensor(x), bias(b), tensor(dy))
                    .into_primitive()
                    .tensor()
            },
        );
    }
}

/// Flex's native loops on primitives in f32; they decline half types and a bias or gradient
/// whose shape does not fit `x`.
#[test]
fn the_flex_loops_match_f64() {
    passes_match_f64::<Flex>(
        &Default::default(),
        FloatDType::F32,
        |x, b| flex::bias_gelu_forward([x, b]).expect("f32 runs natively")[0].clone(),
        |x, b, dy| flex::bias_gelu_backward([x, b, dy]).expect("f32 runs natively")[0].clone(),
    );
    let device = Default::default();
    let x = Tensor::<Flex, 2>::zeros([ROWS, COLUMNS], &device);
    let primitive = |t: Tensor<Flex, 2>| t.into_primitive().tensor();
    let bias = |columns: usize| {
        Tensor::<Flex, 1>::zeros([columns], &device)
            .into_primitive()
            .tensor()
    };
    for dtype in [FloatDType::F16, FloatDType::BF16] {
        let half = primitive(x.clone().cast(dtype));
        assert!(
            flex::bias_gelu_forward([half, bias(COLUMNS)]).is_none(),
            "{dtype:?}"
        );
    }
    assert!(flex::bias_gelu_forward([primitive(x.clone()), bias(COLUMNS - 1)]).is_none());
    let short_grad = primitive(Tensor::zeros([ROWS - 1, COLUMNS], &device));
    assert!(flex::bias_gelu_backward([primitive(x), bias(COLUMNS), short_grad]).is_none());
}

fn kernel_op_matches_f64<B: KernelBackend>() {
    let Some(device) = B::test_device() else {
        return;
    };
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        if has_dtype::<B>(&device, dtype.into()) {
            autodiff_op_matches_f64::<Autodiff<Parallel<B>>>(&device, dtype);
        }
    }
}

#[test]
fn the_kernel_op_matches_f64() {
    on_kernel_backends!(kernel_op_matches_f64());
}

/// A bias that is not one value per column is refused, naming both shapes.
#[test]
#[should_panic(expected = "bias_gelu: bias [36] for input [2, 19, 37]")]
fn a_mismatched_bias_is_named() {
    type A = Autodiff<Parallel<Flex>>;
    let device = Default::default();
    let x = Tensor::<A, 3>::zeros(SHAPE, &device);
    let _ = bias_gelu(x, Tensor::zeros([COLUMNS - 1], &device));
}
