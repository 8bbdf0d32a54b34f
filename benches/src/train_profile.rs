//! `train-profile`: where a tiny-GPT training step spends its time on the CPU backend. Each
//! component of the model runs alone, forward and backward, on the shapes of the tiny config
//! (batch 16, context 128, d 128, 4 heads, vocab 65); times are per call, medians of `iters`,
//! and the "× per step" column says how often a step runs it.

use std::time::Instant;
use wildfire_recipes::CpuBackend;

use burn::backend::{Autodiff, Flex};
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor, TensorData};
use clap::Args;
use wildfire_recipes::model::{
    Gpt, Preset, StageSpec, causal_attention, cross_entropy_sum, gelu_tanh,
};

type B = Autodiff<CpuBackend>;

#[derive(Debug, Args)]
pub struct ProfileArgs {
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    threads: u16,
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u16).range(1..))]
    iters: u16,
}

fn time(iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut samples: Vec<f64> = (0..iters)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[iters / 2]
}

fn input(shape: [usize; 3]) -> Tensor<B, 3> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default()).require_grad()
}

/// Median milliseconds of `f(x)` forward only, and of forward then backward of `sum(f(x))`
/// (reading x's gradient, so that the work is done).
fn measure<const D: usize, const E: usize>(
    iters: usize,
    x: &Tensor<B, D>,
    f: impl Fn(Tensor<B, D>) -> Tensor<B, E>,
) -> (f64, f64) {
    let forward = time(iters, || {
        let _ = f(x.clone()).into_data();
    });
    let both = time(iters, || {
        let grads = f(x.clone()).sum().backward();
        let _ = x.grad(&grads).map(|g| g.into_data());
    });
    (forward, both)
}

/// Median milliseconds of one op on the bare CPU backend.
fn primitive(iters: usize, f: impl Fn() -> Tensor<Flex, 3>) -> f64 {
    time(iters, || {
        let _ = f().into_data();
    })
}

pub fn run(args: ProfileArgs) -> anyhow::Result<()> {
    wildfire_recipes::alloc::keep_freed_memory();
    let iters = usize::from(args.iters);
    rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads.into())
        .build_global()?;
    let device = Default::default();
    B::seed(&device, 0);
    let config = Preset::Tiny.config(65);
    let model = Gpt::<B>::new(&config, StageSpec::whole(&config), &device);
    let block = &model.blocks[0];
    let ln: LayerNorm<B> = LayerNormConfig::new(128).init(&device);
    let x = input([16, 128, 128]);
    let wide = input([16, 128, 512]);
    let scores: Tensor<B, 4> =
        Tensor::random([16, 4, 128, 128], Distribution::Normal(0.0, 1.0), &device).require_grad();
    let heads: Tensor<B, 4> =
        Tensor::random([16, 4, 128, 32], Distribution::Normal(0.0, 1.0), &device).require_grad();
    let layers = config.n_layer as f64;
    let rows: Vec<(&str, f64, (f64, f64))> = vec![
        (
            "layer norm",
            2.0 * layers + 1.0,
            measure(iters, &x, |x| ln.forward(x)),
        ),
        (
            "c_attn linear 128→384",
            layers,
            measure(iters, &x, |x| {
                let c_attn = block.attn.c_attn.as_ref().expect("the GPT's fused QKV");
                c_attn.forward(x)
            }),
        ),
        (
            "attention core",
            layers,
            measure(iters, &x, |x| attention_core(block, x)),
        ),
        (
            "mlp c_fc + gelu + c_proj",
            layers,
            measure(iters, &x, |x| block.mlp.forward(x, &model.tp)),
        ),
        (
            "attn c_proj 128→128",
            layers,
            measure(iters, &x, |x| block.attn.c_proj.forward(x)),
        ),
        (
            "  c_fc 128→512",
            layers,
            measure(iters, &x, |x| block.mlp.c_fc.forward(x)),
        ),
        (
            "  gelu [16,128,512]",
            layers,
            measure(iters, &wide, gelu_tanh),
        ),
        (
            "  mlp c_proj 512→128",
            layers,
            measure(iters, &wide, |x| block.mlp.c_proj.forward(x)),
        ),
        (
            "  softmax [16,4,128,128]",
            layers,
            measure(iters, &scores, |x| softmax(x, 3)),
        ),
        (
            "  q·kᵀ [16,4,128,32]",
            layers,
            measure(iters, &heads, |x| x.clone().matmul(x.swap_dims(2, 3))),
        ),
        (
            "head + cross-entropy",
            1.0,
            measure(iters, &x, |x| head_loss(&model, x)),
        ),
    ];
    let raw: Tensor<Flex, 3> =
        Tensor::random([16, 128, 512], Distribution::Normal(0.0, 1.0), &device);
    let half = raw.clone() * 0.5;
    for (name, ms) in [
        (
            "flex x + y (1M)",
            primitive(iters, || raw.clone() + half.clone()),
        ),
        ("flex x * 0.5 (1M)", primitive(iters, || raw.clone() * 0.5)),
        ("flex exp (1M)", primitive(iters, || raw.clone().exp())),
        (
            "flex sigmoid (1M)",
            primitive(iters, || burn::tensor::activation::sigmoid(raw.clone())),
        ),
        (
            "flex gelu_tanh (1M)",
            primitive(iters, || gelu_tanh(raw.clone())),
        ),
    ] {
        println!("{name:<28} {ms:>10.2} ms");
    }
    println!(
        "{:<28} {:>12} {:>10} {:>10} {:>12}",
        "component", "× per step", "fwd ms", "fwd+bwd", "step share ms"
    );
    let mut total = 0.0;
    for (name, count, (forward, both)) in rows {
        // Indented rows are parts of the row above them.
        if !name.starts_with(' ') {
            total += count * both;
        }
        println!(
            "{name:<28} {count:>12} {forward:>10.2} {both:>10.2} {:>12.1}",
            count * both
        );
    }
    println!(
        "{:<28} {:>12} {:>10} {:>10} {:>12.1}",
        "sum of components", "", "", "", total
    );
    let tokens =
        Tensor::<B, 2, Int>::from_data(TensorData::new(vec![1i64; 16 * 128], [16, 128]), &device);
    let whole = time(iters, || {
        let (loss, _) = cross_entropy_sum(model.forward(tokens.clone()), tokens.clone());
        let _ = model
            .embeddings
            .as_ref()
            .map(|e| e.wte.weight.grad(&loss.backward()));
    });
    println!(
        "{:<28} {:>12} {:>10} {whole:>10.2}",
        "whole model fwd+bwd", 1, ""
    );
    Ok(())
}

fn attention_core(block: &wildfire_recipes::model::Block<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    let [batch, seq, d] = x.dims();
    let heads = 4;
    let split = |t: Tensor<B, 3>| t.reshape([batch, seq, heads, d / heads]).swap_dims(1, 2);
    let y = causal_attention(
        split(x.clone()),
        split(x.clone() * 0.5),
        split(x),
        &block.attn.attn_dropout,
        None,
        None,
    );
    y.swap_dims(1, 2).reshape([batch, seq, d])
}

fn head_loss(model: &Gpt<B>, x: Tensor<B, 3>) -> Tensor<B, 1> {
    let targets = Tensor::<B, 2, Int>::zeros([16, 128], &Default::default());
    cross_entropy_sum(model.logits(x), targets).0
}
