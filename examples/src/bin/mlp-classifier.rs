//! An MLP classifier (a Burn user's model, see `wildfire_examples::mlp`) trained with Burn's
//! `SupervisedTraining` under wildfire's data parallelism:
//!
//! ```text
//! cargo build --release -p wildfire-examples -p wildfire-recipes
//! target/release/mlp-classifier                                   # one process
//! target/release/wildfire launch --nproc-per-node 2 -- target/release/mlp-classifier
//! target/release/wildfire launch --nproc-per-node 2 -- target/release/mlp-classifier --zero 2
//! target/release/wildfire launch --nproc-per-node 2 -- target/release/mlp-classifier --zero 3
//! target/release/wildfire launch --nproc-per-node 2 -- target/release/mlp-classifier --zero 3 \
//!     --offload-optimizer
//! ```
//!
//! Every rank starts from rank 0's parameters (ranks seed differently here to show it), trains
//! on its share of every batch, and rank 0 prints the progress and writes `--dir`.

use std::path::PathBuf;

use anyhow::Context;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use clap::Parser;
use wildfire_backend::Parallel;
use wildfire_backend::comm::{LaunchEnv, LaunchFlags};
use wildfire_examples::mlp::{Run, Shape, StepLog, train};
use wildfire_parallel::fsdp::ZeroStage;
use wildfire_parallel::{DataParallel, ParallelDims};

#[derive(Debug, Parser)]
struct Args {
    /// ZeRO stage: 0 (DDP), 1, 2 or 3 (the hidden blocks sharded).
    #[arg(long, default_value_t = 0)]
    zero: u8,
    /// Units per hidden layer.
    #[arg(long, default_value_t = 32)]
    width: usize,
    /// Hidden blocks (ZeRO 3's units).
    #[arg(long, default_value_t = 2)]
    blocks: usize,
    /// burn-train's artifact directory.
    #[arg(long, default_value = "runs/mlp-classifier")]
    dir: PathBuf,
    /// Points per batch on each rank.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Training points in all.
    #[arg(long, default_value_t = 1024)]
    points: usize,
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Resume from this epoch's checkpoint.
    #[arg(long)]
    resume: Option<usize>,
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// Keep AdamW's moments in host memory and update there (ZeRO-Offload).
    #[arg(long)]
    offload_optimizer: bool,
    /// Writes this rank's losses and final parameters as JSON to `FILE.rank-R.json`.
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let zero = ZeroStage::from_level(args.zero)
        .with_context(|| format!("--zero {} is not a ZeRO stage (0–3)", args.zero))?;
    let env = LaunchEnv::detect(&LaunchFlags::default())?;
    let strategy = DataParallel::from_env(ParallelDims::data(env.world_size, zero))?
        .with_offload(args.offload_optimizer);
    let rank = strategy.mesh().world().rank();
    let run = Run {
        dir: args.dir,
        batch: args.batch,
        points: args.points,
        epochs: args.epochs,
        resume: args.resume,
        seed: 1000 + rank as u64,
        lr: args.lr,
        serial_for_ranks: None,
        shape: Shape {
            width: args.width,
            blocks: args.blocks,
        },
        log: StepLog::default(),
    };
    let outcome = train::<Autodiff<Parallel<Flex>, BalancedCheckpointing>>(strategy, &run)?;
    if let Some(report) = args.report {
        let path = report.with_extension(format!("rank-{rank}.json"));
        std::fs::write(&path, serde_json::to_string(&outcome)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}
