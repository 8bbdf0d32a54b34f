//! Pipeline parallelism: the measured bubble against theory, and what 1F1B stores against GPipe.
//!
//! Every rank is a process (started through the launcher, on its default transport: shared memory on one host), as in a real job.
//!
//! 1. **Equal synthetic stages.** Each stage sleeps `t_f` in its forward and `2·t_f` in its
//!    backward (a recorded autodiff op), so the schedule, the executor and the transport are
//!    measured without CPU contention, at pp = 2 and pp = 4 on any machine. Theory: (p−1)/(m+p−1)
//!    for GPipe and 1F1B, (p−1)/(v·m+p−1) interleaved.
//! 2. **The tiny GPT at pp = 2**, two blocks per stage, one core per rank: the measured bubble,
//!    the peak number of stored activations per rank, and the peak heap growth of a step on each
//!    rank (counted by this binary's allocator), GPipe against 1F1B.
//!
//! The bubble of a rank is its idle share of the step: 1 − (time in forwards and backwards) /
//! (step time); the tables give the mean over ranks and over the measured steps.

use crate::mib;
use std::path::PathBuf;
use std::time::Duration;
use wildfire_recipes::CpuBackend;

use anyhow::Context;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, unary};
use burn::module::{AutodiffModule, Module};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor, TensorPrimitive};
use clap::Args;
use serde::{Deserialize, Serialize};
use wildfire_backend::comm::{CommOptions, HostTensor, LaunchEnv, LaunchFlags, ProcessGroup};
use wildfire_backend::launch::{LaunchConfig, launch};
use wildfire_parallel::pp::{PipelineChunk, Schedule, ScheduleKind, check, partition, run_step};
use wildfire_recipes::model::{Gpt, GptChunks, Preset, StageSpec};
use wildfire_recipes::train::TokenBatch;

use crate::alloc::HEAP;

type B = Autodiff<CpuBackend>;

#[derive(Debug, Args)]
pub struct PpArgs {
    /// Measured steps per configuration (after one warm-up step).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Forward time of a synthetic stage, in milliseconds (the backward takes twice as long).
    #[arg(long, default_value_t = 4.0)]
    forward_ms: f64,
    /// One JSON line per configuration instead of the tables.
    #[arg(long)]
    json: bool,
}

/// One configuration's result, as a JSON line.
#[derive(Debug, Serialize)]
struct Line<'a> {
    stage: &'a str,
    pp: usize,
    microbatches: usize,
    schedule: String,
    virtual_stages: usize,
    bubble: f64,
    bubble_theory: f64,
    peak_activations: &'a [usize],
    heap_growth_bytes: &'a [usize],
}

/// One rank process of a measurement (started by `pp` through the launcher).
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// `sleep` (synthetic stages) or `gpt` (the tiny GPT).
    #[arg(long)]
    stage: String,
    #[arg(long)]
    schedule: ScheduleKind,
    #[arg(long)]
    virtual_stages: usize,
    #[arg(long)]
    microbatches: usize,
    #[arg(long)]
    steps: usize,
    #[arg(long)]
    forward_ms: f64,
    /// Where rank 0 writes the measurements (JSON).
    #[arg(long)]
    out: PathBuf,
}

/// What every rank measured, per measured step.
#[derive(Debug, Serialize, Deserialize)]
struct Measurements {
    /// `bubble[step][rank]`.
    bubble: Vec<Vec<f64>>,
    /// Peak stored activations per rank (the same every step).
    peak_activations: Vec<usize>,
    /// Largest heap growth of a step, per rank, in bytes.
    heap_growth: Vec<usize>,
}

pub fn run(args: PpArgs) -> anyhow::Result<()> {
    let table = |lines: &[&str]| {
        if !args.json {
            lines.iter().for_each(|l| println!("{l}"));
        }
    };
    table(&[
        &format!(
            "## Equal synthetic stages (forward {:.1} ms, backward {:.1} ms), one process per \
             rank\n",
            args.forward_ms,
            2.0 * args.forward_ms
        ),
        "| pp | m | schedule | measured bubble | theory | peak stored activations per rank |",
        "|---|---|---|---|---|---|",
    ]);
    for pp in [2, 4] {
        for m in [4, 8, 16] {
            for (kind, v) in [
                (ScheduleKind::GPipe, 1),
                (ScheduleKind::OneFOneB, 1),
                (ScheduleKind::Interleaved, 2),
            ] {
                let schedule = Schedule::build(kind, pp, v, m)?;
                let measured = launch_workers(&schedule, "sleep", &args)?;
                report(&schedule, "sleep", &measured, args.json)?;
            }
        }
    }
    table(&[
        "\n## Tiny GPT (4 blocks, context 128, 4 sequences per micro-batch) at pp = 2, one \
         process and one core per rank\n",
        "| pp | m | schedule | measured bubble | theory | peak stored activations per rank | \
         peak heap growth of a step per rank |",
        "|---|---|---|---|---|---|---|",
    ]);
    for m in [4, 8, 16] {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let schedule = Schedule::build(kind, 2, 1, m)?;
            let measured = launch_workers(&schedule, "gpt", &args)?;
            report(&schedule, "gpt", &measured, args.json)?;
        }
    }
    Ok(())
}

/// Prints one configuration: a JSON line, or a table row (with the heap column for `gpt`).
fn report(
    schedule: &Schedule,
    stage: &str,
    measured: &Measurements,
    json: bool,
) -> anyhow::Result<()> {
    let all: Vec<f64> = measured.bubble.iter().flatten().copied().collect();
    let mean = all.iter().sum::<f64>() / all.len().max(1) as f64;
    let kind = match schedule.kind {
        ScheduleKind::Interleaved => format!("interleaved v={}", schedule.virtual_stages),
        other => other.to_string(),
    };
    if json {
        let line = Line {
            stage,
            pp: schedule.stages,
            microbatches: schedule.microbatches,
            schedule: schedule.kind.to_string(),
            virtual_stages: schedule.virtual_stages,
            bubble: mean,
            bubble_theory: schedule.theoretical_bubble(),
            peak_activations: &measured.peak_activations,
            heap_growth_bytes: &measured.heap_growth,
        };
        println!("{}", serde_json::to_string(&line)?);
        return Ok(());
    }
    let mut row = format!(
        "| {} | {} | {kind} | {:.1}% | {:.1}% | {:?} |",
        schedule.stages,
        schedule.microbatches,
        100.0 * mean,
        100.0 * schedule.theoretical_bubble(),
        measured.peak_activations
    );
    if stage == "gpt" {
        let mib: Vec<String> = measured
            .heap_growth
            .iter()
            .map(|b| format!("{:.1} MiB", mib(*b)))
            .collect();
        row.push_str(&format!(" {} |", mib.join(", ")));
    }
    println!("{row}");
    Ok(())
}

/// Runs `schedule` with one worker process per rank and returns rank 0's report.
fn launch_workers(schedule: &Schedule, stage: &str, args: &PpArgs) -> anyhow::Result<Measurements> {
    let out = std::env::temp_dir().join(format!("wildfire-pp-bench-{}.json", std::process::id()));
    let exe = std::env::current_exe().context("locating this benchmark binary")?;
    let port = std::net::TcpListener::bind(("127.0.0.1", 0))?
        .local_addr()?
        .port();
    let command = [
        exe.display().to_string(),
        "pp-worker".into(),
        "--stage".into(),
        stage.into(),
        "--schedule".into(),
        schedule.kind.to_string(),
        "--virtual-stages".into(),
        schedule.virtual_stages.to_string(),
        "--microbatches".into(),
        schedule.microbatches.to_string(),
        "--steps".into(),
        args.steps.to_string(),
        "--forward-ms".into(),
        args.forward_ms.to_string(),
        "--out".into(),
        out.display().to_string(),
    ];
    launch(&LaunchConfig {
        nproc_per_node: schedule.stages,
        master_port: port,
        command: command.into(),
        ..Default::default()
    })?;
    let text =
        std::fs::read_to_string(&out).with_context(|| format!("reading {}", out.display()))?;
    let _ = std::fs::remove_file(&out);
    Ok(serde_json::from_str(&text)?)
}

/// One rank: builds its chunks, runs a warm-up and `steps` measured steps, and sends what it
/// measured to rank 0, which writes the report.
pub fn worker(args: WorkerArgs) -> anyhow::Result<()> {
    // One core per rank: the ranks of a pipeline run side by side.
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build_global()?;
    let world = ProcessGroup::init(
        &LaunchEnv::detect(&LaunchFlags::default())?,
        CommOptions::from_env()?,
    )?;
    let schedule = Schedule::build(
        args.schedule,
        world.size(),
        args.virtual_stages,
        args.microbatches,
    )?;
    check(&schedule)?;
    let t_f = Duration::from_secs_f64(args.forward_ms / 1e3);
    let rows = match args.stage.as_str() {
        "sleep" => {
            let chunks: Vec<SleepStage<B>> = (0..args.virtual_stages)
                .map(|_| SleepStage::new(t_f))
                .collect();
            let batches: Vec<_> = (0..args.microbatches).map(|_| synthetic_batch()).collect();
            measure_steps(&schedule, &world, &chunks, &batches, args.steps)?
        }
        "gpt" => {
            let chunks = gpt_chunks(world.rank(), world.size());
            let batches: Vec<_> = (0..args.microbatches).map(token_batch).collect();
            measure_steps(&schedule, &world, &chunks, &batches, args.steps)?
        }
        other => anyhow::bail!("--stage {other:?}: expected sleep or gpt"),
    };
    // rows[step] = [bubble, peak activations, heap growth] of this rank; gather every rank's.
    let flat: Vec<f64> = rows.iter().flatten().copied().collect();
    let len = flat.len();
    let all = world.all_gather_host(HostTensor::new(flat, vec![1, len]), 0)?;
    if world.rank() == 0 {
        let per_rank: Vec<&[f64]> = all.data.chunks(len).collect();
        let report = Measurements {
            bubble: (0..args.steps)
                .map(|step| per_rank.iter().map(|r| r[3 * step]).collect())
                .collect(),
            peak_activations: per_rank.iter().map(|r| r[1] as usize).collect(),
            heap_growth: per_rank
                .iter()
                .map(|r| {
                    (0..args.steps)
                        .map(|s| r[3 * s + 2] as usize)
                        .max()
                        .unwrap_or(0)
                })
                .collect(),
        };
        std::fs::write(&args.out, serde_json::to_string(&report)?)?;
    }
    Ok(())
}

/// A warm-up step, then `steps` measured ones, ranks meeting before each: per step, this rank's
/// `[bubble, peak stored activations, heap growth in bytes]`.
fn measure_steps<C>(
    schedule: &Schedule,
    world: &ProcessGroup,
    chunks: &[C],
    batches: &[C::Batch],
    steps: usize,
) -> anyhow::Result<Vec<[f64; 3]>>
where
    C: PipelineChunk<B> + AutodiffModule<B>,
{
    HEAP.enable();
    let device = Default::default();
    let mut rows = Vec::with_capacity(steps);
    for step in 0..=steps {
        world.barrier()?;
        HEAP.reset_peak();
        let start = HEAP.current();
        let result = run_step(schedule, world.rank(), world, chunks, batches, &device)?;
        let growth = HEAP.peak().saturating_sub(start);
        drop(result.grads);
        if step > 0 {
            let stats = &result.stats;
            rows.push([stats.bubble(), stats.peak_activations as f64, growth as f64]);
        }
    }
    Ok(rows)
}

/// A stage that only waits: `t_f` in its forward, `2·t_f` in its backward.
#[derive(Module, Debug)]
struct SleepStage<B: Backend> {
    linear: Linear<B>,
    forward_us: u64,
}

impl SleepStage<B> {
    fn new(forward: Duration) -> Self {
        Self {
            linear: LinearConfig::new(8, 8).init(&Default::default()),
            forward_us: forward.as_micros() as u64,
        }
    }
}

fn synthetic_batch() -> Tensor<B, 3> {
    Tensor::random([1, 4, 8], Distribution::Default, &Default::default())
}

impl PipelineChunk<B> for SleepStage<B> {
    type Batch = Tensor<B, 3>;

    fn forward(&self, input: Option<Tensor<B, 3>>, batch: &Tensor<B, 3>) -> Tensor<B, 3> {
        let x = input.unwrap_or_else(|| batch.clone());
        std::thread::sleep(Duration::from_micros(self.forward_us));
        let y = self.linear.forward(x);
        sleep_in_backward(y, Duration::from_micros(2 * self.forward_us))
    }

    fn loss(&self, output: Tensor<B, 3>, _batch: &Tensor<B, 3>) -> (Tensor<B, 1>, Tensor<B, 1>) {
        let loss = output.sum();
        (loss.clone(), loss)
    }
}

/// The identity, whose backward sleeps `duration`.
#[derive(Debug)]
struct SleepBackward(Duration);

impl Backward<CpuBackend, 1> for SleepBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        std::thread::sleep(self.0);
        unary::<CpuBackend, _>(ops.parents, ops.node, grads, |grad| grad);
    }
}

fn sleep_in_backward(x: Tensor<B, 3>, duration: Duration) -> Tensor<B, 3> {
    let primitive = x.into_primitive().tensor();
    let node = primitive.node.clone();
    let output = SleepBackward(duration)
        .prepare::<NoCheckpointing>([node])
        .compute_bound()
        .stateless(primitive.primitive);
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// Rank `rank`'s stage of the tiny GPT cut into `pp` stages.
fn gpt_chunks(rank: usize, pp: usize) -> Vec<Gpt<B>> {
    let config = Preset::Tiny.config(76);
    let device = Default::default();
    B::seed(&device, 7);
    let whole = Gpt::<B>::new(&config, StageSpec::whole(&config), &device);
    let stages = partition(config.n_layer, pp, 1, None).expect("4 blocks over the stages");
    GptChunks::for_rank(whole, &stages, pp, rank).chunks
}

/// Micro-batch `mb`: 4 sequences of 128 pseudo-random character ids.
fn token_batch(mb: usize) -> TokenBatch<B> {
    let device = Default::default();
    let ids = |offset: usize| {
        Tensor::<B, 1, Int>::arange(0..512, &device)
            .mul_scalar(37)
            .add_scalar((mb * 11 + offset) as i64)
            .remainder_scalar(76)
            .reshape([4, 128])
    };
    TokenBatch {
        inputs: ids(0),
        targets: ids(1),
        loss_scale: 1.0 / 2048.0,
    }
}
