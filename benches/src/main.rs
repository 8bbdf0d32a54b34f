//! wildfire's benchmark harness: `cargo run --release -p wildfire-benches -- <subcommand>`.

mod activations;
mod alloc;
mod checkpoint;
mod comm;
mod data;
mod decorator;
mod dp;
mod fused_ops;
mod kernels;
mod loss;
mod memory;
mod pp;
mod tp;
mod train;
mod train_profile;

use clap::{Parser, Subcommand};

/// The middle value of `values` (the upper middle for an even count); sorts them.
/// `rounds` alternating rounds of `step(true)` and `step(false)` (the order flipping each
/// round, so that neither always runs first), after one warm-up each: the median of the first
/// value `step` returns for each side, and the second value of each warm-up.
pub(crate) fn alternating<T>(rounds: usize, step: impl Fn(bool) -> (f64, T)) -> [(f64, T); 2] {
    let (_, on_warm) = step(true);
    let (_, off_warm) = step(false);
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for side in [round % 2 == 0, round % 2 != 0] {
            let (value, _) = step(side);
            match side {
                true => on.push(value),
                false => off.push(value),
            }
        }
    }
    [(median(&mut on), on_warm), (median(&mut off), off_warm)]
}

pub(crate) fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// `rows` as JSON lines on standard output, one object per row (the benches' `--json`).
pub(crate) fn print_json_lines<T: serde::Serialize>(rows: &[T]) -> anyhow::Result<()> {
    for row in rows {
        println!("{}", serde_json::to_string(row)?);
    }
    Ok(())
}

/// Bytes in MiB.
pub(crate) fn mib(bytes: usize) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

#[derive(Debug, Parser)]
#[command(
    name = "wildfire-benches",
    about = "wildfire benchmarks (ratios are measured side by side in one run)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Collective bandwidth of every op on the local, shm and tcp transports (and gloo with
    /// PyTorch installed), against a memcpy baseline.
    Comm(comm::CommArgs),
    /// The cost of the `Parallel<B>` decorator with no override active, against the bare backend.
    Decorator(decorator::DecoratorArgs),
    /// Batches per second read from a prepared data directory (see benches/data.sh).
    Data(data::DataArgs),
    /// Training throughput of the tiny GPT on CPU (1 and 2 threads), optionally against PyTorch.
    Train(train::TrainArgs),
    /// Pipeline parallelism: measured bubble against theory; 1F1B's stored activations and
    /// memory against GPipe's.
    Pp(pp::PpArgs),
    /// Model-state bytes per rank under ZeRO 0–3 at dp = 1, 2, 4 (gpt2 preset), and the peak of a
    /// tiny-model training step per stage.
    Memory(memory::MemoryArgs),
    /// Peak heap and step time under activation checkpointing none, full and selective (tiny
    /// and gpt2 presets).
    Activations(activations::ActivationArgs),
    /// The output head's loss, fused (blocks of rows, no whole logits) against the decomposed
    /// loss: peak memory and time of its forward and backward on the CPU backend.
    Loss(loss::LossArgs),
    /// Llama's fused ops (RMSNorm, RoPE, SwiGLU) one at a time against the composed Burn ops,
    /// forward+backward time and the bytes kept for the backward, on the CPU backend.
    FusedOps(fused_ops::FusedOpArgs),
    /// wildfire's CubeCL kernels (attention forward and forward+backward, mixed-precision matmul)
    /// against Burn's own attention and matmul on the same device (wgpu, or CUDA with `cuda`).
    Kernels(kernels::KernelArgs),
    /// What a checkpoint save costs a training step: synchronous against background writes.
    Checkpoint(checkpoint::CheckpointArgs),
    /// Data-parallel throughput of the tiny model at dp = 1 and 2, threads and processes, with
    /// scaling efficiency and the communication share of a step.
    Dp(dp::DpArgs),
    /// Tensor-parallel throughput at tp = 2 against tp = 1 (tiny and gpt2 presets), with the
    /// share of a step spent in collectives.
    Tp(tp::TpArgs),
    /// One training process of `dp` and `tp`.
    #[command(hide = true)]
    RecipeWorker(dp::WorkerArgs),
    /// Where a tiny-GPT training step spends its time, component by component.
    TrainProfile(train_profile::ProfileArgs),
    /// One measurement process of `train`.
    #[command(hide = true)]
    TrainWorker(train::WorkerArgs),
    /// One rank of a pipeline measurement (started by `pp` through the launcher).
    #[command(hide = true)]
    PpWorker(pp::WorkerArgs),
    /// One rank of a shm or tcp measurement (started by `comm` through the launcher).
    #[command(hide = true)]
    CommWorker(comm::WorkerArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Comm(args) => comm::run(args),
        Command::CommWorker(args) => comm::worker(args),
        Command::Decorator(args) => decorator::run(args),
        Command::Data(args) => data::run(args),
        Command::Pp(args) => pp::run(args),
        Command::Memory(args) => memory::run(args),
        Command::Activations(args) => activations::run(args),
        Command::FusedOps(args) => fused_ops::run(args),
        Command::Loss(args) => loss::run(args),
        Command::Dp(args) => dp::run(args),
        Command::Checkpoint(args) => checkpoint::run(args),
        Command::Kernels(args) => kernels::run(args),
        Command::Tp(args) => tp::run(args),
        Command::RecipeWorker(args) => dp::worker(args),
        Command::PpWorker(args) => pp::worker(args),
        Command::Train(args) => train::run(args),
        Command::TrainWorker(args) => train::worker(args),
        Command::TrainProfile(args) => train_profile::run(args),
    }
}
