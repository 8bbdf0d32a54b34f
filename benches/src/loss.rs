//! `loss`: the output head's loss, fused (`kernels::cross_entropy`: the head's product and the
//! cross-entropy in blocks of rows, gradients computed in the forward) against the decomposed
//! loss (the whole logits, then `log_softmax` and a gather, Burn's autodiff for the backward),
//! forward+backward on the CPU backend (`Autodiff<Parallel<Flex>>`), f32, a tied head
//! (`W: [V, d]`).
//!
//! Per shape and variant: the peak heap growth over the loss's forward and backward, the
//! gradients of the hidden rows and of the weight included (the counting allocator; the inputs
//! excluded), and the median time of the rounds, the two variants alternating.

use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Distribution, Int, Tensor};
use clap::Args;
use serde::Serialize;
use wildfire_backend::Parallel;
use wildfire_backend::kernels::cross_entropy::{
    HeadLayout, IGNORE_INDEX, LinearCrossEntropy, logits_cross_entropy_sum,
};

use crate::alloc::HEAP;
use crate::{alternating, mib, print_json_lines};

type A = Autodiff<Parallel<Flex>>;

#[derive(Debug, Args)]
pub struct LossArgs {
    /// Rounds per variant (each a forward and a backward), after one warm-up each.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Only these shapes (repeatable; default: all of them).
    #[arg(long = "shape", value_name = "NAME")]
    shapes: Vec<String>,
    /// Print one JSON object per line instead of the table.
    #[arg(long)]
    json: bool,
}

/// (name, vocabulary, width, rows): GPT-2's vocabulary and width at the activations bench's
/// gpt2 micro-batch (4 × 256 tokens); Llama 3's vocabulary at the same width and rows; and at
/// Llama 3.2 1B's width.
const SHAPES: [(&str, usize, usize, usize); 3] = [
    ("gpt2", 50_304, 768, 1024),
    ("llama3-vocab", 128_256, 768, 1024),
    ("llama3-1b", 128_256, 2048, 1024),
];

#[derive(Debug, Serialize)]
struct Row {
    shape: &'static str,
    vocab: usize,
    width: usize,
    rows: usize,
    /// Rows per block of the fused loss.
    block_rows: usize,
    fused_peak_mib: f64,
    decomposed_peak_mib: f64,
    /// fused_peak_mib / decomposed_peak_mib.
    memory_ratio: f64,
    /// The weight's gradient alone (f32), which both variants produce.
    weight_grad_mib: f64,
    fused_ms: f64,
    decomposed_ms: f64,
    /// fused_ms / decomposed_ms.
    time_ratio: f64,
}

pub fn run(args: LossArgs) -> anyhow::Result<()> {
    wildfire_recipes::alloc::register(&HEAP);
    HEAP.enable();
    let mut rows = Vec::new();
    for (shape, vocab, width, count) in SHAPES {
        if !args.shapes.is_empty() && !args.shapes.iter().any(|s| s == shape) {
            continue;
        }
        rows.push(measure(shape, vocab, width, count, args.rounds));
    }
    report(&rows, args.json)
}

/// One shape: both variants, alternating.
fn measure(shape: &'static str, vocab: usize, width: usize, rows: usize, rounds: usize) -> Row {
    let device = Default::default();
    let hidden = Tensor::<A, 2>::random([rows, width], Distribution::Normal(0.0, 1.0), &device);
    let weight = Tensor::<A, 2>::random([vocab, width], Distribution::Normal(0.0, 0.02), &device);
    let targets =
        Tensor::<A, 1, Int>::random([rows], Distribution::Uniform(0.0, vocab as f64), &device);
    let layout = HeadLayout::VocabRows;
    let loss = LinearCrossEntropy::new();
    let step = |fused: bool| {
        let (x, w) = (hidden.clone().require_grad(), weight.clone().require_grad());
        let before = HEAP.current();
        HEAP.reset_peak();
        let start = Instant::now();
        let value = match fused {
            true => loss.loss_sum(x, w, layout, targets.clone()).unwrap(),
            false => {
                let logits = layout.logits(x, w);
                logits_cross_entropy_sum(logits, targets.clone(), IGNORE_INDEX)
            }
        };
        let grads = value.backward();
        let ms = start.elapsed().as_secs_f64() * 1e3;
        let peak = HEAP.peak().saturating_sub(before);
        drop(grads);
        (ms, peak)
    };
    let [(fused_ms, fused_peak), (decomposed_ms, decomposed_peak)] = alternating(rounds, step);
    Row {
        shape,
        vocab,
        width,
        rows,
        block_rows: loss.rows_per_chunk(vocab),
        fused_peak_mib: mib(fused_peak),
        decomposed_peak_mib: mib(decomposed_peak),
        memory_ratio: fused_peak as f64 / decomposed_peak as f64,
        weight_grad_mib: mib(vocab * width * 4),
        fused_ms,
        decomposed_ms,
        time_ratio: fused_ms / decomposed_ms,
    }
}

fn report(rows: &[Row], json: bool) -> anyhow::Result<()> {
    if json {
        return print_json_lines(rows);
    }
    println!(
        "{:<13} {:>7} {:>5} {:>5} {:>6} {:>10} {:>10} {:>6} {:>9} {:>9} {:>9} {:>6}",
        "shape",
        "V",
        "d",
        "rows",
        "block",
        "fused MiB",
        "decomp MiB",
        "ratio",
        "dW MiB",
        "fused ms",
        "decomp ms",
        "ratio"
    );
    for r in rows {
        println!(
            "{:<13} {:>7} {:>5} {:>5} {:>6} {:>10.1} {:>10.1} {:>6.3} {:>9.1} {:>9.0} {:>9.0} {:>6.3}",
            r.shape,
            r.vocab,
            r.width,
            r.rows,
            r.block_rows,
            r.fused_peak_mib,
            r.decomposed_peak_mib,
            r.memory_ratio,
            r.weight_grad_mib,
            r.fused_ms,
            r.decomposed_ms,
            r.time_ratio
        );
    }
    Ok(())
}
