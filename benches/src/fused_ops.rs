//! `fused-ops`: each of Llama's fused ops against the composed Burn ops the model runs with
//! `train.fused_ops = false`, one op at a time, on the CPU backend (`Autodiff<Parallel<Flex>>`)
//! at a preset's shapes for one micro-batch (one block's use of the op):
//!
//! - **RMSNorm**: `Norm::forward` with `fused` on (`kernels::layer_norm`, uncentred) and off
//!   (`x / √(mean(x²) + ε) · γ` in Burn ops), on `[batch, seq, d]`;
//! - **RoPE**: `Rotary::apply` (`kernels::rope`) and `Rotary::apply_composed` on the queries,
//!   `[batch, seq, heads, head_dim]`;
//! - **SwiGLU**: `gated_silu` fused (`kernels::swiglu`) and composed, on `[batch, seq, hidden]`.
//!
//! Per op: the median forward+backward time over alternating rounds (the backward of
//! `Σ y ∘ dy`, so the op's own backward runs on a dense gradient), and the bytes the forward
//! leaves for the backward: the live heap after the forward less the live heap before it (the
//! counting allocator; the output and the graph's saved tensors, the inputs excluded).

use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::tensor::{Distribution, Tensor};
use clap::Args;
use serde::Serialize;
use wildfire_backend::Parallel;
use wildfire_recipes::model::rope::Rotary;
use wildfire_recipes::model::{Norm, Preset, gated_silu};

use crate::alloc::HEAP;
use crate::{alternating, mib, print_json_lines};

type A = Autodiff<Parallel<Flex>>;

#[derive(Debug, Args)]
pub struct FusedOpArgs {
    /// The model whose shapes the ops run at.
    #[arg(long, value_enum, default_value = "llama-tiny")]
    preset: Preset,
    #[arg(long, default_value_t = 16)]
    micro_batch: usize,
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Alternating rounds (fused, composed) per op.
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Print one JSON object per line instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Row {
    op: &'static str,
    shape: String,
    fused_ms: f64,
    composed_ms: f64,
    /// composed_ms / fused_ms: above 1, the fused op is faster.
    speedup: f64,
    fused_kept_mib: f64,
    composed_kept_mib: f64,
    /// composed_kept_mib / fused_kept_mib.
    memory_ratio: f64,
}

/// One op's forward on a fresh leaf input (`fused` picks the variant); what the backward needs
/// is built inside.
type Forward<'a> = Box<dyn Fn(bool) -> Tensor<A, 3> + 'a>;

pub fn run(args: FusedOpArgs) -> anyhow::Result<()> {
    wildfire_recipes::alloc::register(&HEAP);
    HEAP.enable();
    let config = args.preset.config(65);
    let device = Default::default();
    let (batch, seq) = (args.micro_batch, args.context);
    let draw = |shape: [usize; 3]| Tensor::<A, 3>::random(shape, Distribution::Default, &device);
    let rows_shape = [batch, seq, config.d_model];
    let norm = Norm {
        gamma: Param::from_tensor(Tensor::ones([config.d_model], &device)),
        beta: None,
        rms: true,
        eps: config.norm_eps,
    };
    let (heads, head_dim) = (config.n_head, config.head_dim());
    let rotary = Rotary::new(
        head_dim,
        seq,
        config.rope_theta,
        config.rope_scaling.as_ref(),
    );
    let hidden_shape = [batch, seq, config.ffn_hidden];
    let (x, q) = (draw(rows_shape), draw([batch, seq, heads * head_dim]));
    let (gate, up) = (draw(hidden_shape), draw(hidden_shape));
    let ops: Vec<(&'static str, [usize; 3], Forward)> = vec![
        (
            "RMSNorm",
            rows_shape,
            Box::new(|fused| norm.forward(x.clone().require_grad(), fused)),
        ),
        (
            "RoPE (queries)",
            [batch, seq, heads * head_dim],
            Box::new(|fused| {
                let heads_view = q
                    .clone()
                    .require_grad()
                    .reshape([batch, seq, heads, head_dim]);
                rotary
                    .apply(heads_view, 0, fused)
                    .reshape([batch, seq, heads * head_dim])
            }),
        ),
        (
            "SwiGLU",
            hidden_shape,
            Box::new(|fused| {
                gated_silu(
                    gate.clone().require_grad(),
                    up.clone().require_grad(),
                    fused,
                )
            }),
        ),
    ];
    let rows: Vec<Row> = ops
        .iter()
        .map(|(op, shape, forward)| measure(op, *shape, forward, args.rounds))
        .collect();
    report(&rows, args.json)
}

/// The op's time and kept bytes, fused and composed, in alternating rounds.
fn measure(op: &'static str, shape: [usize; 3], forward: &Forward, rounds: usize) -> Row {
    let output_grad = Tensor::<A, 3>::random(shape, Distribution::Default, &Default::default());
    let step = |fused: bool| {
        let start = Instant::now();
        let before = HEAP.current();
        let y = forward(fused);
        let kept = HEAP.current().saturating_sub(before);
        let _ = (y * output_grad.clone()).sum().backward();
        (start.elapsed().as_secs_f64() * 1e3, kept)
    };
    let [(fused_ms, fused_kept), (composed_ms, composed_kept)] = alternating(rounds, step);
    Row {
        op,
        shape: format!("{shape:?}"),
        fused_ms,
        composed_ms,
        speedup: composed_ms / fused_ms,
        fused_kept_mib: mib(fused_kept),
        composed_kept_mib: mib(composed_kept),
        memory_ratio: composed_kept as f64 / fused_kept as f64,
    }
}

fn report(rows: &[Row], json: bool) -> anyhow::Result<()> {
    if json {
        return print_json_lines(rows);
    }
    println!(
        "{:<16} {:<16} {:>9} {:>11} {:>8} {:>10} {:>13} {:>7}",
        "op", "shape", "fused ms", "composed ms", "speedup", "fused MiB", "composed MiB", "ratio"
    );
    for r in rows {
        println!(
            "{:<16} {:<16} {:>9.3} {:>11.3} {:>8.2} {:>10.2} {:>13.2} {:>7.2}",
            r.op,
            r.shape,
            r.fused_ms,
            r.composed_ms,
            r.speedup,
            r.fused_kept_mib,
            r.composed_kept_mib,
            r.memory_ratio
        );
    }
    Ok(())
}
