//! The fused linear cross-entropy (`kernels::cross_entropy`) against the decomposed loss of the
//! whole logits (`logits_cross_entropy_sum`, Burn's autodiff for the gradients) on the same
//! backend: `Autodiff<Parallel<_>>` over Flex in f32 and bf16 (mixed precision: the head's
//! products in bf16 on both sides) and over the kernel backends (wgpu on lavapipe; CUDA in a
//! `--features cuda` build) in f32, both weight layouts, blocks of 7 rows over 30 (the last
//! block short), a vocabulary of 37, three rows ignored.
//!
//! Bounds, on the loss and each gradient against the largest magnitude of the decomposed one's:
//! f32 1e-5 (the two sum the same terms in other orders and blocks; on CUDA plus 4× TF32's
//! roundoff, which Burn's f32 matmul may use there); bf16 4u (u = 2⁻⁸), since
//! the weight's gradient is rounded to bf16 once per block of rows and then once more, where the
//! decomposed product rounds once.

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use wildfire_backend::Parallel;
use wildfire_backend::compare::relative_difference;
use wildfire_backend::kernels::cross_entropy::{
    FusedCrossEntropyBackend, HeadLayout, IGNORE_INDEX, LinearCrossEntropy,
    logits_cross_entropy_sum,
};

use crate::common::{KernelBackend, signed_values, tensor_of, unit_roundoff};

const ROWS: usize = 30;
const WIDTH: usize = 16;
const VOCAB: usize = 37;

fn weight_dims(layout: HeadLayout) -> [usize; 2] {
    match layout {
        HeadLayout::VocabRows => [VOCAB, WIDTH],
        HeadLayout::VocabColumns => [WIDTH, VOCAB],
    }
}

/// `[loss, ∂/∂hidden, ∂/∂weight]` (as f32) of the fused loss (`fused`) or the decomposed one on
/// backend `A`, the inputs in `dtype`.
fn loss_and_grads<A: AutodiffBackend + FusedCrossEntropyBackend>(
    device: &A::Device,
    layout: HeadLayout,
    dtype: FloatDType,
    fused: bool,
) -> [Vec<f32>; 3] {
    let hidden = tensor_of::<A, 2>(&signed_values(ROWS * WIDTH, 3, 2.0), [ROWS, WIDTH], device)
        .cast(dtype)
        .require_grad();
    let weight = signed_values(VOCAB * WIDTH, 5, 1.0);
    let weight = tensor_of::<A, 2>(&weight, weight_dims(layout), device)
        .cast(dtype)
        .require_grad();
    let ids: Vec<i64> = (0..ROWS)
        .map(|i| match i % 11 {
            4 => IGNORE_INDEX,
            _ => ((i * 13 + 5) % VOCAB) as i64,
        })
        .collect();
    let targets = Tensor::<A, 1, Int>::from_data(TensorData::new(ids, [ROWS]), device);
    let loss = match fused {
        true => LinearCrossEntropy::new()
            .with_chunk_rows(7)
            .loss_sum(hidden.clone(), weight.clone(), layout, targets)
            .expect("no collectives"),
        false => {
            let logits = layout.logits(hidden.clone(), weight.clone());
            logits_cross_entropy_sum(logits, targets, IGNORE_INDEX)
        }
    };
    let grads = loss.backward();
    let read = |t: Tensor<A::InnerBackend, 2>| -> Vec<f32> {
        t.cast(FloatDType::F32).into_data().to_vec().unwrap()
    };
    [
        loss.into_data().to_vec().unwrap(),
        read(hidden.grad(&grads).unwrap()),
        read(weight.grad(&grads).unwrap()),
    ]
}

/// Fused against decomposed on backend `A`, within `bound` of each decomposed value's largest
/// magnitude.
fn fused_matches_decomposed<A: AutodiffBackend + FusedCrossEntropyBackend>(
    device: &A::Device,
    dtype: FloatDType,
    bound: f64,
) {
    for layout in [HeadLayout::VocabRows, HeadLayout::VocabColumns] {
        let fused = loss_and_grads::<A>(device, layout, dtype, true);
        let decomposed = loss_and_grads::<A>(device, layout, dtype, false);
        for (name, (got, expected)) in ["loss", "hidden", "weight"]
            .iter()
            .zip(fused.iter().zip(&decomposed))
        {
            let difference = relative_difference(got, expected);
            assert!(
                difference <= bound,
                "{} {layout:?} {dtype:?} {name}: {difference:e} apart (bound {bound:e})",
                A::name(device)
            );
        }
    }
}

#[test]
fn fused_loss_matches_the_decomposed_loss_on_flex() {
    type A = Autodiff<Parallel<Flex>>;
    let device = Default::default();
    fused_matches_decomposed::<A>(&device, FloatDType::F32, 1e-5);
    let bound = 4.0 * unit_roundoff(FloatDType::BF16);
    fused_matches_decomposed::<A>(&device, FloatDType::BF16, bound);
}

fn on_kernel_backend<B: KernelBackend>() {
    let Some(device) = B::test_device() else {
        return;
    };
    let bound = 1e-5 + 4.0 * B::F32_MATMUL_INPUT_ROUNDOFF;
    fused_matches_decomposed::<Autodiff<Parallel<B>>>(&device, FloatDType::F32, bound);
}

#[test]
fn fused_loss_matches_the_decomposed_loss_on_the_kernel_backends() {
    on_kernel_backends!(on_kernel_backend());
}
