//! `decorator`: the cost of `Parallel<B>` with no override active. The same op mix runs on the
//! bare backend and through the decorator, alternating in rounds so that both see the same
//! machine noise; the report is the median over rounds of decorated time / bare time.

use crate::median;
use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::{gelu, softmax};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, Tensor};
use clap::Args;
use serde::Serialize;
use wildfire_backend::Parallel;

#[derive(Debug, Args)]
pub struct DecoratorArgs {
    /// Print one JSON object per line instead of the table.
    #[arg(long)]
    json: bool,
    /// Alternating rounds (bare, decorated) per mix.
    #[arg(long, default_value_t = 15)]
    rounds: usize,
    /// Op-mix iterations per round.
    #[arg(long, default_value_t = 20)]
    iters: usize,
}

#[derive(Debug, Serialize)]
struct Record {
    mix: &'static str,
    bare_s: f64,
    decorated_s: f64,
    ratio: f64,
}

/// A transformer-block-like mix: matmuls, bias add, GELU, softmax, a reduction, a reshape.
fn forward<B: Backend>(x: &Tensor<B, 2>, w1: &Tensor<B, 2>, w2: &Tensor<B, 2>) -> Tensor<B, 2> {
    let h = gelu(x.clone().matmul(w1.clone()).add_scalar(0.1));
    let attention = softmax(h.clone().matmul(h.clone().transpose()).div_scalar(16.0), 1);
    let mixed = attention.matmul(h).matmul(w2.clone());
    let centred = mixed.clone() - mixed.mean_dim(1);
    centred.reshape([x.dims()[0], x.dims()[1]])
}

fn inputs<B: Backend>() -> [Tensor<B, 2>; 3] {
    let device = Default::default();
    let t =
        |shape: [usize; 2]| Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 0.1), &device);
    [t([128, 256]), t([256, 512]), t([512, 256])]
}

fn time_forward<B: Backend>(iters: usize) -> f64 {
    let [x, w1, w2] = inputs::<B>();
    let start = Instant::now();
    for _ in 0..iters {
        let _ = forward(&x, &w1, &w2).into_data();
    }
    start.elapsed().as_secs_f64()
}

fn time_training<B: AutodiffBackend>(iters: usize) -> f64 {
    let [x, w1, w2] = inputs::<B>();
    let (w1, w2) = (w1.require_grad(), w2.require_grad());
    let start = Instant::now();
    for _ in 0..iters {
        let grads = forward(&x, &w1, &w2).sum().backward();
        let _ = w1.grad(&grads).map(Tensor::into_data);
    }
    start.elapsed().as_secs_f64()
}

fn compare(
    mix: &'static str,
    rounds: usize,
    bare: impl Fn() -> f64,
    decorated: impl Fn() -> f64,
) -> Record {
    bare();
    decorated();
    let mut ratios = Vec::with_capacity(rounds);
    let (mut bare_total, mut decorated_total) = (0.0, 0.0);
    for round in 0..rounds {
        // Alternate which goes first, so neither always runs on a warmer machine.
        let (b, d) = if round % 2 == 0 {
            let b = bare();
            (b, decorated())
        } else {
            let d = decorated();
            (bare(), d)
        };
        bare_total += b;
        decorated_total += d;
        ratios.push(d / b);
    }
    Record {
        mix,
        bare_s: bare_total / rounds as f64,
        decorated_s: decorated_total / rounds as f64,
        ratio: median(&mut ratios),
    }
}

pub fn run(args: DecoratorArgs) -> anyhow::Result<()> {
    let (rounds, iters) = (args.rounds.max(1), args.iters.max(1));
    let records = [
        compare(
            "forward (Flex vs Parallel<Flex>)",
            rounds,
            || time_forward::<Flex>(iters),
            || time_forward::<Parallel<Flex>>(iters),
        ),
        compare(
            "forward+backward (Autodiff<Flex> vs Autodiff<Parallel<Flex>>)",
            rounds,
            || time_training::<Autodiff<Flex>>(iters),
            || time_training::<Autodiff<Parallel<Flex>>>(iters),
        ),
    ];
    if !args.json {
        println!(
            "{:<62} {:>10} {:>12} {:>16}",
            "op mix", "bare (s)", "decorated (s)", "median ratio"
        );
    }
    for r in &records {
        if args.json {
            println!("{}", serde_json::to_string(r)?);
        } else {
            println!(
                "{:<62} {:>10.4} {:>12.4} {:>16.4}",
                r.mix, r.bare_s, r.decorated_s, r.ratio
            );
        }
    }
    Ok(())
}
