//! The fused loss against the decomposed one (`logits_cross_entropy_sum` of the whole logits,
//! Burn's autodiff for the gradients) on `Autodiff<Parallel<Flex>>`, in f32.

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Int, Tensor, TensorData};

use super::*;
use crate::compare::relative_difference;

type P = Parallel<Flex>;
type A = Autodiff<P>;

const ROWS: usize = 10;
const WIDTH: usize = 6;
const VOCAB: usize = 13;

/// Deterministic values in [−scale, scale].
fn values(n: usize, seed: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7919 + seed * 104_729) % 2001) as f32 / 1000.0 - 1.0) * scale)
        .collect()
}

/// Targets over the vocabulary, rows 2 and 7 ignored.
fn targets() -> Vec<i64> {
    (0..ROWS)
        .map(|i| match i {
            2 | 7 => IGNORE_INDEX,
            _ => ((i * 5 + 3) % VOCAB) as i64,
        })
        .collect()
}

fn weight_dims(layout: HeadLayout) -> [usize; 2] {
    match layout {
        HeadLayout::VocabRows => [VOCAB, WIDTH],
        HeadLayout::VocabColumns => [WIDTH, VOCAB],
    }
}

/// `[loss, ∂/∂hidden, ∂/∂weight]` of `loss(hidden, weight, targets)`, the hidden rows as
/// `[2, 5, d]`.
fn loss_and_grads(
    layout: HeadLayout,
    loss: impl Fn(Tensor<A, 3>, Tensor<A, 2>, Tensor<A, 2, Int>) -> Tensor<A, 1>,
) -> [Vec<f32>; 3] {
    let device = Default::default();
    let hidden = Tensor::<A, 1>::from_floats(values(ROWS * WIDTH, 1, 2.0).as_slice(), &device)
        .reshape([2, ROWS / 2, WIDTH])
        .require_grad();
    let weight = Tensor::<A, 1>::from_floats(values(VOCAB * WIDTH, 2, 1.5).as_slice(), &device)
        .reshape(weight_dims(layout))
        .require_grad();
    let targets =
        Tensor::<A, 2, Int>::from_data(TensorData::new(targets(), [2, ROWS / 2]), &device);
    let value = loss(hidden.clone(), weight.clone(), targets);
    let grads = value.backward();
    let read = |t: TensorData| t.to_vec::<f32>().unwrap();
    [
        read(value.into_data()),
        read(hidden.grad(&grads).unwrap().into_data()),
        read(weight.grad(&grads).unwrap().into_data()),
    ]
}

fn decomposed(layout: HeadLayout) -> [Vec<f32>; 3] {
    loss_and_grads(layout, |hidden, weight, targets| {
        let logits = layout.logits(hidden.reshape([ROWS, WIDTH]), weight);
        logits_cross_entropy_sum(logits, targets.reshape([ROWS]), IGNORE_INDEX)
    })
}

fn fused(layout: HeadLayout, loss: &LinearCrossEntropy) -> [Vec<f32>; 3] {
    loss_and_grads(layout, |hidden, weight, targets| {
        loss.loss_sum(hidden, weight, layout, targets).unwrap()
    })
}

/// The loss and both gradients within f32 rounding of the decomposed loss's, for both layouts
/// and blocks of 1, 3 (not dividing the 10 rows), 10 and the default, with two rows ignored.
/// The sums run over at most 13 terms of magnitude ≤ 10, so 1e-5 of the largest value is a few
/// dozen ulps of it.
#[test]
fn fused_loss_and_gradients_match_the_decomposed_ones() {
    for layout in [HeadLayout::VocabRows, HeadLayout::VocabColumns] {
        let expected = decomposed(layout);
        for rows in [Some(1), Some(3), Some(ROWS), None] {
            let loss = match rows {
                Some(rows) => LinearCrossEntropy::new().with_chunk_rows(rows),
                None => LinearCrossEntropy::new(),
            };
            let got = fused(layout, &loss);
            for ((name, got), expected) in
                ["loss", "hidden", "weight"].iter().zip(&got).zip(&expected)
            {
                let difference = relative_difference(got, expected);
                assert!(
                    difference <= 1e-5,
                    "{layout:?}, blocks of {rows:?} rows, {name}: {difference:e} apart\n\
                     fused {got:?}\ndecomposed {expected:?}"
                );
            }
        }
    }
}

/// An ignored row has no gradient; the others have.
#[test]
fn ignored_rows_have_no_gradient() {
    let [_, hidden_grad, _] = fused(
        HeadLayout::VocabRows,
        &LinearCrossEntropy::new().with_chunk_rows(4),
    );
    for row in 0..ROWS {
        let grad = &hidden_grad[row * WIDTH..(row + 1) * WIDTH];
        let ignored = row == 2 || row == 7;
        assert_eq!(
            grad.iter().all(|&g| g == 0.0),
            ignored,
            "row {row}: {grad:?}"
        );
    }
}

/// Without autodiff (an evaluation) the loop computes the loss alone: bitwise the autodiff
/// forward's value.
#[test]
fn the_untracked_loss_is_the_tracked_one() {
    let layout = HeadLayout::VocabColumns;
    let loss = LinearCrossEntropy::new().with_chunk_rows(3);
    let tracked = fused(layout, &loss)[0][0];
    let device = Default::default();
    let hidden = Tensor::<P, 1>::from_floats(values(ROWS * WIDTH, 1, 2.0).as_slice(), &device)
        .reshape([ROWS, WIDTH]);
    let weight = Tensor::<P, 1>::from_floats(values(VOCAB * WIDTH, 2, 1.5).as_slice(), &device)
        .reshape(weight_dims(layout));
    let targets = Tensor::<P, 1, Int>::from_data(TensorData::new(targets(), [ROWS]), &device);
    let untracked = loss.loss_sum(hidden, weight, layout, targets).unwrap();
    assert_eq!(untracked.into_scalar().to_bits(), tracked.to_bits());
}

/// Blocks hold at most `CHUNK_ELEMENTS` logits, in multiples of 16 rows, but at least
/// `MIN_CHUNK_ROWS` rows.
#[test]
fn default_blocks_fit_the_budget() {
    let loss = LinearCrossEntropy::new();
    assert_eq!(loss.rows_per_chunk(50_304), 80);
    assert_eq!(loss.rows_per_chunk(128_256), MIN_CHUNK_ROWS);
    assert_eq!(loss.rows_per_chunk(1 << 24), MIN_CHUNK_ROWS);
    assert_eq!(loss.rows_per_chunk(100), CHUNK_ELEMENTS / 100 / 16 * 16);
    assert_eq!(loss.with_chunk_rows(7).rows_per_chunk(100), 7);
}

#[test]
#[should_panic(expected = "hidden [10, 6] and a VocabRows weight [13, 5]")]
fn a_weight_of_another_width_is_refused() {
    let device = Default::default();
    let hidden = Tensor::<P, 2>::zeros([ROWS, WIDTH], &device);
    let weight = Tensor::<P, 2>::zeros([VOCAB, 5], &device);
    let targets = Tensor::<P, 1, Int>::zeros([ROWS], &device);
    let _ = LinearCrossEntropy::new().loss_sum(hidden, weight, HeadLayout::VocabRows, targets);
}

#[test]
#[should_panic(expected = "hidden [10, 6] and targets [9]")]
fn targets_of_another_length_are_refused() {
    let device = Default::default();
    let hidden = Tensor::<P, 2>::zeros([ROWS, WIDTH], &device);
    let weight = Tensor::<P, 2>::zeros([VOCAB, WIDTH], &device);
    let targets = Tensor::<P, 1, Int>::zeros([ROWS - 1], &device);
    let _ = LinearCrossEntropy::new().loss_sum(hidden, weight, HeadLayout::VocabRows, targets);
}
