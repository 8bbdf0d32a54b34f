//! The fused SwiGLU (`kernels::swiglu`) against `silu(g)·u` and its derivatives in f64: the
//! CubeCL kernels directly on wgpu (Mesa's lavapipe on CI; and CUDA in a `--features cuda`
//! build), Flex's native loops and the reference in Burn ops directly, and the autodiff op,
//! output and both gradients, on `Autodiff<Parallel<Flex>>` (the loops in f32, the reference in
//! half types) and on the kernel backends.
//!
//! Inputs are `[2, 19, 37]` with gates in [−8, 8] and up projections in [−2, 2], plus gates
//! where `e^−g` overflows (−100, −1e4) and underflows (100). Tolerances, elementwise against the
//! f64 value `e` from the same (rounded) inputs: `|got − e| ≤ 2⁻¹⁷(1 + |e|)` for the f32
//! exp-and-quotient (an `exp` within a few ulps), plus the output type's unit roundoff times
//! `|e|` (each output is rounded once from f32).
//!
//! bf16 has no WGSL type, so on lavapipe the bf16 kernel cases report themselves skipped.

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Tensor, TensorPrimitive};
use wildfire_backend::Parallel;
use wildfire_backend::kernels::swiglu::{
    FusedSwigluBackend, backward_kernel, flex, forward_kernel, reference_backward,
    reference_forward, swiglu,
};

use crate::common::{
    KernelBackend, compare_to_f64, has_dtype, rounded, signed_values, tensor_of, unit_roundoff,
};

const SHAPE: [usize; 3] = [2, 19, 37];
const ROWS: usize = SHAPE[0] * SHAPE[1];
const COLUMNS: usize = SHAPE[2];

/// The inputs `g`, `u` and output gradient `dy` (f32 values), with the saturated gates first.
fn inputs() -> [Vec<f32>; 3] {
    let mut gate = signed_values(ROWS * COLUMNS, 11, 8.0);
    gate[..3].copy_from_slice(&[-100.0, -1e4, 100.0]);
    let up = signed_values(ROWS * COLUMNS, 13, 2.0);
    [gate, up, signed_values(ROWS * COLUMNS, 17, 1.0)]
}

/// The exact `[y, dg, du]` from the inputs rounded to `dtype`.
fn exact(dtype: FloatDType) -> [Vec<f64>; 3] {
    let [gate, up, grad] =
        inputs().map(|v| v.into_iter().map(|x| rounded(x, dtype)).collect::<Vec<_>>());
    let sigmoid = |g: f64| 1.0 / (1.0 + (-g).exp());
    let each = |f: &dyn Fn(f64, f64, f64) -> f64| -> Vec<f64> {
        (0..gate.len())
            .map(|i| f(gate[i], up[i], grad[i]))
            .collect()
    };
    [
        each(&|g, u, _| g * sigmoid(g) * u),
        each(&|g, u, dy| dy * u * sigmoid(g) * (1.0 + g * (1.0 - sigmoid(g)))),
        each(&|g, _, dy| dy * g * sigmoid(g)),
    ]
}

/// `[y, dg, du]` against f64 in `dtype`, named `what`; panics listing the failures.
fn assert_matches_f64(what: &str, dtype: FloatDType, got: [Tensor<impl Backend, 2>; 3]) {
    let u = unit_roundoff(dtype);
    let failures: Vec<String> = ["y", "dg", "du"]
        .into_iter()
        .zip(got)
        .zip(exact(dtype))
        .flat_map(|((name, got), exact)| {
            assert_eq!(got.dtype(), DType::from(dtype), "{what} {name}: its type");
            compare_to_f64(&format!("{what} {name}"), got.into_data(), &exact, u, 1.0)
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The two passes on primitives of backend `B` in `dtype`: `forward(g, u)` and
/// `backward(g, u, dy)`.
fn passes_match_f64<B: Backend>(
    device: &B::Device,
    dtype: FloatDType,
    forward: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
    backward: impl Fn(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) -> [FloatTensor<B>; 2],
) {
    let [gate, up, grad] = inputs().map(|v| {
        tensor_of::<B, 2>(&v, [ROWS, COLUMNS], device)
            .cast(dtype)
            .into_primitive()
            .tensor()
    });
    let y = forward(gate.clone(), up.clone());
    let [dg, du] = backward(gate, up, grad);
    let tensor = |t| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t));
    let what = format!("{} {dtype:?}", B::name(device));
    assert_matches_f64(&what, dtype, [tensor(y), tensor(dg), tensor(du)]);
}

fn kernels_match_f64<B: KernelBackend>(dtype: FloatDType) {
    let Some(device) = B::test_device() else {
        return;
    };
    if has_dtype::<B>(&device, dtype.into()) {
        passes_match_f64::<B>(
            &device,
            dtype,
            |g, u| forward_kernel(g, u).expect("forward kernel"),
            |g, u, dy| backward_kernel(g, u, dy).expect("backward kernel"),
        );
    }
}

#[test]
fn the_kernels_match_f64() {
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        on_kernel_backends!(kernels_match_f64(dtype));
    }
}

/// The autodiff op on backend `A`: `y`, `dg` and `du` against f64, for inputs in `dtype`.
fn autodiff_op_matches_f64<A: AutodiffBackend + FusedSwigluBackend>(
    device: &A::Device,
    dtype: FloatDType,
) {
    let [gate, up, grad] = inputs().map(|v| tensor_of::<A, 3>(&v, SHAPE, device).cast(dtype));
    let (gate, up) = (gate.require_grad(), up.require_grad());
    let y = swiglu(gate.clone(), up.clone());
    let grads = (y.clone().cast(FloatDType::F32) * grad.cast(FloatDType::F32))
        .sum()
        .backward();
    let flat = |t: Tensor<A::InnerBackend, 3>| t.reshape([ROWS, COLUMNS]);
    let dg = flat(gate.grad(&grads).expect("g has a gradient"));
    let du = flat(up.grad(&grads).expect("u has a gradient"));
    let what = format!("{} {dtype:?}", A::name(device));
    assert_matches_f64(&what, dtype, [flat(y.inner()), dg, du]);
}

/// On `Parallel<Flex>` the op runs the native loops in f32 and the reference in half types.
#[test]
fn the_flex_op_matches_f64() {
    type A = Autodiff<Parallel<Flex>>;
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        autodiff_op_matches_f64::<A>(&Default::default(), dtype);
    }
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

/// The reference in Burn ops, in every type.
#[test]
fn the_reference_matches_f64() {
    let tensor =
        |t: FloatTensor<Flex>| Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(t));
    let primitive = |t: Tensor<Flex, 2>| t.into_primitive().tensor();
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        passes_match_f64::<Flex>(
            &Default::default(),
            dtype,
            |g, u| primitive(reference_forward(tensor(g), tensor(u))),
            |g, u, dy| reference_backward(tensor(g), tensor(u), tensor(dy)).map(primitive),
        );
    }
}

/// Flex's native loops on primitives in f32; they decline half types and inputs of two shapes.
#[test]
fn the_flex_loops_match_f64() {
    passes_match_f64::<Flex>(
        &Default::default(),
        FloatDType::F32,
        |g, u| flex::forward([g, u]).expect("f32 runs natively")[0].clone(),
        |g, u, dy| flex::backward([g, u, dy]).expect("f32 runs natively"),
    );
    let device = Default::default();
    let zeros = |rows: usize| Tensor::<Flex, 2>::zeros([rows, COLUMNS], &device);
    let primitive = |t: Tensor<Flex, 2>| t.into_primitive().tensor();
    for dtype in [FloatDType::F16, FloatDType::BF16] {
        let half = primitive(zeros(ROWS).cast(dtype));
        assert!(flex::forward([half.clone(), half]).is_none(), "{dtype:?}");
    }
    assert!(flex::forward([primitive(zeros(ROWS)), primitive(zeros(ROWS - 1))]).is_none());
    let [g, u, short] = [ROWS, ROWS, ROWS - 1].map(|rows| primitive(zeros(rows)));
    assert!(flex::backward([g, u, short]).is_none());
}

/// A gate and an up projection of different shapes are refused, naming both.
#[test]
#[should_panic(expected = "swiglu: gate [2, 19, 37] F32 and up [2, 19, 36] F32")]
fn mismatched_inputs_are_named() {
    type A = Autodiff<Parallel<Flex>>;
    let device = Default::default();
    let _ = swiglu(
        Tensor::<A, 3>::zeros(SHAPE, &device),
        Tensor::<A, 3>::zeros([2, 19, 36], &device),
    );
}
