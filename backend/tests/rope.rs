//! The rotary embedding's CubeCL kernel (`kernels::rope`) against its reference in Burn ops on
//! the same device (wgpu on Mesa's lavapipe on CI; and CUDA in a `--features cuda` build): the
//! kernel directly, and the autodiff op's output and input gradient on `Autodiff<Parallel<B>>`
//! against the reference under `Autodiff<B>`.
//!
//! Shapes `[2, 5, 3, 6]` (3 pairs per head) and `[2, 7, 4, 64]`, inputs and angles drawn in
//! [−1, 1) and [−π, π), the tables holding each angle in both halves as the model's do. Each
//! element is `x·c + b·s`, the reference's expression; a GPU compiler may contract it into a
//! fused multiply-add, so the two agree within a few units of the type's roundoff relative to
//! the largest output (f32: 2⁻²¹; f16: 2⁻⁹), not bitwise. bf16 has no WGSL type, so on lavapipe
//! the bf16 case reports itself skipped.

use burn::backend::Autodiff;
use burn::tensor::{FloatDType, Tensor, TensorPrimitive};
use wildfire_backend::Parallel;
use wildfire_backend::kernels::rope::{reference, rope, rope_kernel};

use crate::common::{KernelBackend, has_dtype, relative_error, signed_values, tensor_of};

const SHAPES: [[usize; 4]; 2] = [[2, 5, 3, 6], [2, 7, 4, 64]];

/// `[x, cos, sin, dy]` for `shape`, in f32.
fn inputs(shape: [usize; 4], seed: u64) -> [Vec<f32>; 4] {
    let [batch, seq, heads, width] = shape;
    let elements = batch * seq * heads * width;
    let angles = signed_values(seq * width / 2, seed, std::f32::consts::PI);
    let table = |f: fn(f32) -> f32| -> Vec<f32> {
        angles
            .chunks(width / 2)
            .flat_map(|row| row.iter().map(|&a| f(a)).collect::<Vec<_>>().repeat(2))
            .collect()
    };
    [
        signed_values(elements, seed + 1, 1.0),
        table(f32::cos),
        table(f32::sin),
        signed_values(elements, seed + 2, 1.0),
    ]
}

/// The bound on the relative error in `dtype`.
fn tolerance(dtype: FloatDType) -> f32 {
    match dtype {
        FloatDType::F32 => 2f32.powi(-21),
        _ => 2f32.powi(-9),
    }
}

/// The kernel on primitives and the autodiff op, against the reference on the same device.
fn kernel_matches_reference<B: KernelBackend>(dtype: FloatDType) {
    let Some(device) = B::test_device() else {
        return;
    };
    if !has_dtype::<B>(&device, dtype.into()) {
        return;
    }
    for (seed, shape) in SHAPES.into_iter().enumerate() {
        let [_, seq, _, width] = shape;
        let [x, cos, sin, dy] = inputs(shape, 10 * seed as u64);
        let activation = |v: &[f32]| tensor_of::<B, 4>(v, shape, &device).cast(dtype);
        let table = |v: &[f32]| tensor_of::<B, 2>(v, [seq, width], &device).cast(dtype);
        let what = format!("{} {dtype:?} {shape:?}", B::name(&device));
        let primitive = |t: Tensor<B, 4>| t.into_primitive().tensor();
        let table_primitive = |t: Tensor<B, 2>| t.into_primitive().tensor();
        let direct = rope_kernel(
            primitive(activation(&x)),
            table_primitive(table(&cos)),
            table_primitive(table(&sin)),
        )
        .expect("the kernel takes these inputs");
        let direct = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(direct));
        let expected = reference(activation(&x), table(&cos), table(&sin));
        let error = relative_error(direct.into_data(), expected.into_data());
        assert!(error <= tolerance(dtype), "{what} kernel: {error:e}");

        let [fused, composed] = [true, false].map(|fused| {
            let x =
                Tensor::<Autodiff<Parallel<B>>, 4>::from_data(activation(&x).into_data(), &device)
                    .require_grad();
            let table = |v: &[f32]| Tensor::from_data(table(v).into_data(), &device);
            let (cos, sin) = (table(&cos), table(&sin));
            let y = match fused {
                true => rope(x.clone(), cos, sin),
                false => reference(x.clone(), cos, sin),
            };
            let dy = Tensor::from_data(activation(&dy).into_data(), &device);
            let grads = (y.clone() * dy).sum().backward();
            [
                y.into_data(),
                x.grad(&grads).expect("x has a gradient").into_data(),
            ]
        });
        for ((name, got), expected) in ["y", "dx"].iter().zip(fused).zip(composed) {
            let error = relative_error(got, expected);
            assert!(error <= tolerance(dtype), "{what} op {name}: {error:e}");
        }
    }
}

#[test]
fn the_kernel_matches_the_reference() {
    for dtype in [FloatDType::F32, FloatDType::F16, FloatDType::BF16] {
        on_kernel_backends!(kernel_matches_reference(dtype));
    }
}
