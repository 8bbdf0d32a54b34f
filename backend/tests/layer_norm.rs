//! The fused LayerNorm and RMSNorm's CubeCL kernels (`kernels::layer_norm::cube`) against the
//! norm and its gradients in f64, on wgpu (Mesa's lavapipe on CI; and CUDA in a `--features
//! cuda` build): the kernels directly, and the autodiff op on `Autodiff<Parallel<B>>`, whose
//! output and `dx` must be the kernels' bit for bit (it routes to them).
//!
//! Shapes `[3, 7]`, `[2, 5, 200]`, `[300, 96]` (three blocks of rows for `dγ` and `dβ`) and
//! `[2, 1000]` (a row longer than its cube), rows of mean 0.5; `x` in f32 or f16 with `γ, β`
//! in `x`'s type or in f32. The exact values come from the inputs as rounded to their types.
//!
//! Tolerance, as `max |got − e| / max |e|` per output: 2⁻¹⁴ for the f32 arithmetic (the sums
//! over a row are trees of at most 8 levels over runs of at most 4 terms, those over rows runs
//! of 128 then 3 terms: a relative error of at most about 130 ulps of the sum of the terms'
//! magnitudes, and the random signs leave the sums within a few times those magnitudes'
//! root-mean-square), plus the output type's unit roundoff (f16: 2⁻¹¹) where the output is
//! rounded to it. bf16 has no WGSL type, so on lavapipe the bf16 cases report themselves
//! skipped.

use burn::backend::Autodiff;
use burn::tensor::{FloatDType, Tensor, TensorData, TensorPrimitive};
use wildfire_backend::Parallel;
use wildfire_backend::kernels::layer_norm::cube::{backward_kernel, forward_kernel};
use wildfire_backend::kernels::layer_norm::{layer_norm, rms_norm};

use crate::common::{
    KernelBackend, has_dtype, relative_error, rounded, signed_values, unit_roundoff,
};

const EPSILON: f64 = 1e-5;

/// The inputs' shapes, `[rows, columns]` and as the tensor is given.
const SHAPES: [(&[usize], [usize; 2]); 4] = [
    (&[3, 7], [3, 7]),
    (&[2, 5, 200], [10, 200]),
    (&[300, 96], [300, 96]),
    (&[2, 1000], [2, 1000]),
];

/// `[x, γ, β, dy]` for `rows × columns`, as f32 values.
fn inputs([rows, columns]: [usize; 2], seed: u64) -> [Vec<f32>; 4] {
    let shifted = |v: Vec<f32>, by: f32| v.into_iter().map(|x| x + by).collect();
    [
        shifted(signed_values(rows * columns, seed, 1.0), 0.5),
        shifted(signed_values(columns, seed + 1, 0.5), 1.0),
        signed_values(columns, seed + 2, 1.0),
        signed_values(rows * columns, seed + 3, 1.0),
    ]
}

/// `[y, dx, dγ, dβ]` in f64 of the norm of the rows of `x` (centred for LayerNorm), `dy` the
/// output gradient: the formulas of `kernels::layer_norm`'s module doc.
fn exact([x, gamma, beta, dy]: &[Vec<f64>; 4], columns: usize, centred: bool) -> [Vec<f64>; 4] {
    let n = columns as f64;
    let (mut y, mut dx) = (Vec::new(), Vec::new());
    let (mut dgamma, mut dbeta) = (vec![0.0; columns], vec![0.0; columns]);
    for (row, row_dy) in x.chunks(columns).zip(dy.chunks(columns)) {
        let mean = if centred {
            row.iter().sum::<f64>() / n
        } else {
            0.0
        };
        let variance = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        let r = 1.0 / (variance + EPSILON).sqrt();
        let normalised: Vec<f64> = row.iter().map(|v| (v - mean) * r).collect();
        let g: Vec<f64> = row_dy.iter().zip(gamma).map(|(d, c)| d * c).collect();
        let g_mean = if centred {
            g.iter().sum::<f64>() / n
        } else {
            0.0
        };
        let g_normalised_mean = g.iter().zip(&normalised).map(|(a, b)| a * b).sum::<f64>() / n;
        for c in 0..columns {
            y.push(normalised[c] * gamma[c] + beta[c]);
            dx.push(r * (g[c] - g_mean - normalised[c] * g_normalised_mean));
            dgamma[c] += row_dy[c] * normalised[c];
            dbeta[c] += row_dy[c];
        }
    }
    [y, dx, dgamma, dbeta]
}

/// `values` as a tensor of `shape` in `dtype` on `device`.
fn tensor<B: KernelBackend, const D: usize>(
    values: &[f32],
    shape: &[usize],
    dtype: FloatDType,
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::<B, D>::from_data(TensorData::new(values.to_vec(), shape.to_vec()), device).cast(dtype)
}

/// `got` within the f32 arithmetic's bound plus `dtype`'s roundoff of `exact`, named `what`.
fn assert_near(what: &str, got: TensorData, exact: &[f64], dtype: FloatDType) {
    let exact = TensorData::new(exact.iter().map(|&e| e as f32).collect(), [exact.len()]);
    let got = TensorData::new(
        got.convert::<f32>().to_vec::<f32>().unwrap(),
        [exact.num_elements()],
    );
    let bound = (2f64.powi(-14) + unit_roundoff(dtype)) as f32;
    let error = relative_error(got, exact);
    assert!(
        error <= bound,
        "{what}: relative error {error:e} (bound {bound:e})"
    );
}

/// The kernels and the autodiff op against f64 for `x` in `dtype`, `γ` and `β` in
/// `parameter_dtype`.
fn kernels_match_f64<B: KernelBackend>(dtype: FloatDType, parameter_dtype: FloatDType) {
    let Some(device) = B::test_device() else {
        return;
    };
    if !has_dtype::<B>(&device, dtype.into()) || !has_dtype::<B>(&device, parameter_dtype.into()) {
        return;
    }
    for (seed, (shape, rows_columns)) in SHAPES.into_iter().enumerate() {
        let columns = rows_columns[1];
        let values = inputs(rows_columns, 10 * seed as u64);
        let types = [dtype, parameter_dtype, parameter_dtype, dtype];
        let as_rounded =
            |i: usize| -> Vec<f64> { values[i].iter().map(|&v| rounded(v, types[i])).collect() };
        let rounded_inputs = [0, 1, 2, 3].map(as_rounded);
        for centred in [true, false] {
            let what = format!(
                "{} x {dtype:?}, parameters {parameter_dtype:?}, {shape:?}, centred: {centred}",
                B::name(&device)
            );
            let mut rounded_inputs = rounded_inputs.clone();
            if !centred {
                rounded_inputs[2] = vec![0.0; columns];
            }
            let expected = exact(&rounded_inputs, columns, centred);
            let activation = |i: usize| tensor::<B, 3>(&values[i], &padded(shape), dtype, &device);
            let parameter =
                |i: usize| tensor::<B, 1>(&values[i], &[columns], parameter_dtype, &device);
            let primitive = |t: Tensor<B, 3>| t.into_primitive().tensor();
            let parameter_primitive = |t: Tensor<B, 1>| t.into_primitive().tensor();
            let beta = match centred {
                true => parameter(2),
                false => parameter(2).zeros_like(),
            };
            let y = forward_kernel(
                primitive(activation(0)),
                parameter_primitive(parameter(1)),
                parameter_primitive(beta),
                EPSILON,
                centred,
            )
            .expect("the forward kernel takes these inputs");
            let [dx, dgamma, dbeta] = backward_kernel(
                primitive(activation(0)),
                parameter_primitive(parameter(1)),
                primitive(activation(3)),
                EPSILON,
                centred,
            )
            .expect("the backward kernels take these inputs");
            let data = |p| Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(p)).into_data();
            let vector = |p| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(p)).into_data();
            let (y, dx, dgamma, dbeta) = (data(y), data(dx), vector(dgamma), vector(dbeta));
            assert_near(&format!("{what}: y"), y.clone(), &expected[0], dtype);
            assert_near(&format!("{what}: dx"), dx.clone(), &expected[1], dtype);
            assert_near(
                &format!("{what}: dγ"),
                dgamma,
                &expected[2],
                FloatDType::F32,
            );
            assert_near(&format!("{what}: dβ"), dbeta, &expected[3], FloatDType::F32);

            let op =
                op_output_and_grads::<B>(&values, shape, dtype, parameter_dtype, centred, &device);
            assert_eq!(op[0], y, "{what}: the op's y is not the kernel's");
            assert_eq!(op[1], dx, "{what}: the op's dx is not the kernel's");
            let op_dgamma = format!("{what}: the op's dγ");
            assert_near(&op_dgamma, op[2].clone(), &expected[2], parameter_dtype);
        }
    }
}

/// `shape` as three dimensions (leading ones added).
fn padded(shape: &[usize]) -> Vec<usize> {
    let mut padded = vec![1; 3 - shape.len()];
    padded.extend_from_slice(shape);
    padded
}

/// `[y, dx, dγ]` of `Σ y ∘ dy` through the autodiff op on `Autodiff<Parallel<B>>`.
fn op_output_and_grads<B: KernelBackend>(
    values: &[Vec<f32>; 4],
    shape: &[usize],
    dtype: FloatDType,
    parameter_dtype: FloatDType,
    centred: bool,
    device: &B::Device,
) -> [TensorData; 3] {
    type A<B> = Autodiff<Parallel<B>>;
    let columns = shape[shape.len() - 1];
    let activation = |i: usize| {
        let data = TensorData::new(values[i].clone(), padded(shape));
        Tensor::<A<B>, 3>::from_data(data, device).cast(dtype)
    };
    let parameter = |i: usize| {
        let data = TensorData::new(values[i].clone(), [columns]);
        Tensor::<A<B>, 1>::from_data(data, device)
            .cast(parameter_dtype)
            .require_grad()
    };
    let (x, gamma) = (activation(0).require_grad(), parameter(1));
    let y = match centred {
        true => layer_norm(x.clone(), gamma.clone(), Some(parameter(2)), EPSILON),
        false => rms_norm(x.clone(), gamma.clone(), EPSILON),
    };
    let grads = (y.clone() * activation(3)).sum().backward();
    [
        y.into_data(),
        x.grad(&grads).expect("x has a gradient").into_data(),
        gamma.grad(&grads).expect("γ has a gradient").into_data(),
    ]
}

#[test]
fn the_kernels_match_the_norm_in_f64() {
    for (dtype, parameter_dtype) in [
        (FloatDType::F32, FloatDType::F32),
        (FloatDType::F16, FloatDType::F16),
        (FloatDType::F16, FloatDType::F32),
        (FloatDType::BF16, FloatDType::F32),
    ] {
        on_kernel_backends!(kernels_match_f64(dtype, parameter_dtype));
    }
}
