//! An MLP classifier (a Burn user's model, see `wildfire_examples::mlp`) trained with Burn's
//! `SupervisedTraining` under wildfire's data parallelism, or split by its tensor-parallel plan:
//!
//! ```text
//! cargo build --release -p wildfire-examples -p wildfire-recipes
//! target/release/mlp-classifier                                   # one process
//! target/release/wildfire launch --nproc-per-node 2 -- target/release/mlp-classifier
//! target/release/wildfire launch --nproc-per-node 2 -- target/release/mlp-classifier --zero 2
//! target/release/wildfire launch --nproc-per-node 2 -- target/release/mlp-classifier --zero 3
//! target/release/wildfire launch --nproc-per-node 2 -- target/release/mlp-classifier --zero 3 \
//!     --offload-optimizer
//! target/release/wildfire launch --nproc-per-node 2 -- target/release/mlp-classifier --tp 2
//! target/release/wildfire launch --nproc-per-node 2 -- target/release/mlp-classifier --tp 2 \
//!     --sequence-parallel
//! target/release/wildfire launch --nproc-per-node 2 -- target/release/mlp-classifier --pp 2 \
//!     --schedule 1f1b --microbatches 4
//! target/release/wildfire launch --nproc-per-node 2 -- target/release/mlp-classifier --tp 2 \
//!     --epochs 1 --checkpoint-dir runs/mlp-ckpt --checkpoint-every 32
//! target/release/wildfire launch --nproc-per-node 4 -- target/release/mlp-classifier --tp 2 \
//!     --pp 2 --checkpoint-dir runs/mlp-ckpt --checkpoint-every 32   # resumes at step 64
//! ```
//!
//! Data-parallel: every rank starts from rank 0's parameters (ranks seed differently here to
//! show it), trains on its share of every batch, and rank 0 prints the progress and writes
//! `--dir`. Tensor-parallel (`--tp`, every process one rank of it): the model is split by its
//! plan (`wildfire_examples::tensor_parallel`), every rank trains on every batch, and rank 0
//! prints the losses. Pipeline (`--pp`): each process holds one stage of the model cut after
//! its first hidden block (`wildfire_examples::pipeline`), and the last stage prints the losses;
//! `--tp` and `--pp` together split each stage by the plan. Under `--tp` or `--pp`,
//! `--checkpoint-dir` keeps checkpoints (every `--checkpoint-every` steps) and a run resumes from
//! the newest one there, at any `--tp` and `--pp`.

use std::path::PathBuf;

use anyhow::Context;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use clap::Parser;
use wildfire_backend::Parallel;
use wildfire_backend::comm::{LaunchEnv, LaunchFlags};
use wildfire_examples::checkpoints::Checkpoints;
use wildfire_examples::mlp::parameters;
use wildfire_examples::mlp::{LoopRun, Outcome, Run, Shape, StepLog, train};
use wildfire_examples::{pipeline, tensor_parallel};
use wildfire_parallel::fsdp::ZeroStage;
use wildfire_parallel::pp::ScheduleKind;
use wildfire_parallel::{DataParallel, Mesh, ParallelDims};

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
    /// Tensor-parallel ranks (every process): the hidden blocks split by the model's plan.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Under `--tp`, split the points between the tensor-parallel layer pairs.
    #[arg(long)]
    sequence_parallel: bool,
    /// Pipeline stages (every process one): the model cut after each of its first `pp - 1`
    /// hidden blocks.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Under `--pp`: the schedule, `gpipe` or `1f1b`.
    #[arg(long, default_value = "1f1b")]
    schedule: ScheduleKind,
    /// Under `--pp`: micro-batches per batch (they divide `--batch`).
    #[arg(long, default_value_t = 4)]
    microbatches: usize,
    /// Under `--tp` or `--pp`: where checkpoints are kept; a run resumes from the newest one.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Under `--checkpoint-dir`: a checkpoint after every this many steps (0: none).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: usize,
    /// Writes this rank's losses and final parameters as JSON to `FILE.rank-R.json`.
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let zero = ZeroStage::from_level(args.zero)
        .with_context(|| format!("--zero {} is not a ZeRO stage (0–3)", args.zero))?;
    let env = LaunchEnv::detect(&LaunchFlags::default())?;
    if args.pp > 1 {
        return train_pipeline(&args, env.world_size);
    }
    if args.tp > 1 || args.checkpoint_dir.is_some() {
        return train_tensor_parallel(&args, env.world_size);
    }
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

/// The run of `--tp` and `--pp`: every batch on every rank, the model drawn from one seed.
fn loop_run(args: &Args) -> LoopRun {
    LoopRun {
        shape: Shape {
            width: args.width,
            blocks: args.blocks,
        },
        seed: 1000,
        batch: args.batch,
        steps: args.points / args.batch * args.epochs,
        lr: args.lr,
        checkpoints: (args.checkpoint_dir.clone()).map(|dir| Checkpoints {
            dir,
            every: args.checkpoint_every,
        }),
    }
}

/// The mesh of `dims` over every process, which must be `tp × pp` of them.
fn mesh_of(dims: ParallelDims, world_size: usize) -> anyhow::Result<Mesh> {
    let ranks = dims.tp * dims.pp;
    anyhow::ensure!(
        world_size == ranks,
        "--tp {} --pp {} needs {ranks} processes (wildfire launch --nproc-per-node {ranks}), not \
         {world_size}",
        dims.tp,
        dims.pp
    );
    Ok(Mesh::from_env(dims)?)
}

/// Prints the losses (every tenth and the last), and writes `--report` for `rank`.
fn finish(args: &Args, rank: usize, print: bool, outcome: Outcome) -> anyhow::Result<()> {
    if print {
        // A resumed run took the steps after its checkpoint's.
        let first = loop_run(args).steps - outcome.losses.len();
        for (taken, loss) in outcome.losses.iter().enumerate().step_by(10) {
            println!("step {:>5}  loss {loss:.4}", first + taken);
        }
        let last = outcome.losses.last().copied().unwrap_or(f32::NAN);
        println!("final loss {last:.4}");
    }
    if let Some(report) = &args.report {
        let path = report.with_extension(format!("rank-{rank}.json"));
        std::fs::write(&path, serde_json::to_string(&outcome)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// `--tp`: the model split by its plan over every process, trained in a loop of Burn's pieces.
fn train_tensor_parallel(args: &Args, world_size: usize) -> anyhow::Result<()> {
    let dims = ParallelDims {
        tp: args.tp,
        sequence_parallel: args.sequence_parallel,
        ..ParallelDims::default()
    };
    let mesh = mesh_of(dims, world_size)?;
    let group = mesh.tensor();
    let trained = tensor_parallel::train::<Autodiff<Parallel<Flex>>>;
    let (model, losses) = trained(&loop_run(args), args.sequence_parallel, group)?;
    let parameters = model.parameters();
    finish(
        args,
        group.rank(),
        group.rank() == 0,
        Outcome { losses, parameters },
    )
}

/// `--pp`: one stage per pipeline rank, the model cut after each of its first `pp - 1` blocks
/// (and each stage split by the plan under `--tp`).
fn train_pipeline(args: &Args, world_size: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.sequence_parallel,
        "--sequence-parallel is for --tp alone: the pipeline's stages hand over whole points"
    );
    let dims = ParallelDims {
        pp: args.pp,
        tp: args.tp,
        ..ParallelDims::default()
    };
    let mesh = mesh_of(dims, world_size)?;
    let group = mesh.pipeline();
    let cuts: Vec<usize> = (1..args.pp).collect();
    let trained = pipeline::train::<Autodiff<Parallel<Flex>>>;
    let (stage, losses) = trained(
        &loop_run(args),
        &cuts,
        args.schedule,
        args.microbatches,
        &mesh,
    )?;
    let outcome = Outcome {
        losses: losses.into_iter().map(|loss| loss as f32).collect(),
        parameters: parameters(&stage),
    };
    let last = group.rank() + 1 == group.size() && mesh.tensor().rank() == 0;
    finish(args, mesh.world().rank(), last, outcome)
}
