//! `dp`: data-parallel training throughput of the recipe's tiny GPT (batch 16 per rank, context
//! 128) at dp = 1 and dp = 2, with ranks as threads of one process and as processes (shared memory), from
//! the run's own metrics: median tokens/s over the steps after 3 warm-up steps, scaling
//! efficiency against one rank on one core, and the share of step time spent in the gradient
//! all-reduce. Every configuration runs in its own process (the thread pool is sized once per
//! process), through [`RecipeRun`], which the `tp` benchmark shares.

use crate::{median, print_json_lines};
use std::path::{Path, PathBuf};
use std::process::Command;
use wildfire_recipes::CpuBackend;

use anyhow::{Context, bail};
use burn::backend::Autodiff;
use clap::Args;
use serde::Serialize;
use serde_json::Value;
use wildfire_backend::launch::{LaunchConfig, launch};
use wildfire_recipes::config::RunConfig;

const WARMUP: usize = 3;

#[derive(Debug, Args)]
pub struct DpArgs {
    /// Print one JSON object per line instead of the table.
    #[arg(long)]
    json: bool,
    /// Training steps per configuration (the first 3 are warm-up).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(5..))]
    steps: u64,
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    #[arg(long)]
    threads: usize,
    #[arg(long)]
    transport: String,
    #[arg(long)]
    steps: u64,
    #[arg(long)]
    dir: PathBuf,
    /// Config overrides (`KEY=VALUE`), e.g. `parallel.dp=2`.
    #[arg(long = "set")]
    sets: Vec<String>,
}

/// One configuration of the recipe to measure: `ranks` ranks (processes through the launcher,
/// or threads of one process), `threads` compute threads per process, and the config
/// overrides `sets`.
#[derive(Debug, Clone)]
pub(crate) struct RecipeRun {
    pub name: String,
    pub ranks: usize,
    pub threads: usize,
    pub processes: bool,
    pub sets: Vec<String>,
}

impl RecipeRun {
    /// Trains `steps` steps in worker processes of this benchmark binary and returns what the
    /// run's metrics say (see [`measured`]).
    pub fn measure(&self, steps: u64) -> anyhow::Result<(f64, f64, f64)> {
        let exe = std::env::current_exe().context("locating this benchmark binary")?;
        let dir = std::env::temp_dir().join(format!(
            "wildfire-bench-{}-{}",
            std::process::id(),
            self.name.replace([' ', ',', '×'], "")
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let worker = |transport: &str| {
            let mut command = vec![
                exe.display().to_string(),
                "recipe-worker".into(),
                "--threads".into(),
                self.threads.to_string(),
                "--transport".into(),
                transport.into(),
                "--steps".into(),
                steps.to_string(),
                "--dir".into(),
                dir.display().to_string(),
            ];
            for set in &self.sets {
                command.extend(["--set".to_string(), set.clone()]);
            }
            command
        };
        if self.processes {
            let port = std::net::TcpListener::bind(("127.0.0.1", 0))?
                .local_addr()?
                .port();
            launch(&LaunchConfig {
                nproc_per_node: self.ranks,
                master_port: port,
                command: worker("launch"),
                ..Default::default()
            })?;
        } else {
            let command = worker("local");
            let status = Command::new(&command[0]).args(&command[1..]).status()?;
            if !status.success() {
                bail!("{}: the worker failed ({status})", self.name);
            }
        }
        let result = measured(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        result
    }
}

#[derive(Debug, Clone, Copy)]
struct Layout {
    name: &'static str,
    dp: usize,
    /// Compute threads per process.
    threads: usize,
    processes: bool,
}

#[derive(Debug, Serialize)]
struct Row {
    layout: &'static str,
    dp: usize,
    threads_per_process: usize,
    processes: bool,
    tokens_per_sec: f64,
    step_ms: f64,
    comm_share: f64,
    /// tokens/s ÷ (dp × tokens/s of one rank on one core).
    efficiency: f64,
}

const LAYOUTS: [Layout; 4] = [
    Layout {
        name: "dp 1, 1 core",
        dp: 1,
        threads: 1,
        processes: false,
    },
    Layout {
        name: "dp 1, 2 cores",
        dp: 1,
        threads: 2,
        processes: false,
    },
    Layout {
        name: "dp 2, threads",
        dp: 2,
        threads: 2,
        processes: false,
    },
    Layout {
        name: "dp 2, processes",
        dp: 2,
        threads: 1,
        processes: true,
    },
];

pub fn run(args: DpArgs) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    let mut one_core = None;
    for layout in LAYOUTS {
        let run = RecipeRun {
            name: layout.name.to_string(),
            ranks: layout.dp,
            threads: layout.threads,
            processes: layout.processes,
            sets: vec![format!("parallel.dp={}", layout.dp)],
        };
        let (tokens_per_sec, step_ms, comm_share) = run.measure(args.steps)?;
        let baseline = *one_core.get_or_insert(tokens_per_sec);
        rows.push(Row {
            layout: layout.name,
            dp: layout.dp,
            threads_per_process: layout.threads,
            processes: layout.processes,
            tokens_per_sec,
            step_ms,
            comm_share,
            efficiency: tokens_per_sec / (layout.dp as f64 * baseline),
        });
    }
    if args.json {
        return print_json_lines(&rows);
    }
    println!(
        "| layout | tokens/s | step | all-reduce share | efficiency vs dp 1 on 1 core |\n|---|---|---|---|---|"
    );
    for row in &rows {
        println!(
            "| {} | {:.0} | {:.0} ms | {:.1}% | {:.2} |",
            row.layout,
            row.tokens_per_sec,
            row.step_ms,
            100.0 * row.comm_share,
            row.efficiency
        );
    }
    Ok(())
}

/// Median tokens/s and step time after warm-up, and Σ comm / Σ step time, from metrics.jsonl.
pub(crate) fn measured(dir: &Path) -> anyhow::Result<(f64, f64, f64)> {
    let path = dir.join("metrics.jsonl");
    let steps = train_records(dir, WARMUP)?;
    let field = |key: &str| -> Vec<f64> { steps.iter().filter_map(|v| v[key].as_f64()).collect() };
    let (mut tokens, mut times, comm) = (
        field("tokens_per_sec"),
        field("step_time_ms"),
        field("comm_ms"),
    );
    if tokens.is_empty() {
        bail!("{} has no measured steps", path.display());
    }
    let share = comm.iter().sum::<f64>() / times.iter().sum::<f64>();
    Ok((median(&mut tokens), median(&mut times), share))
}

/// The training records of the run in `dir` (its `metrics.jsonl`), after the first `skip`.
pub(crate) fn train_records(dir: &Path, skip: usize) -> anyhow::Result<Vec<Value>> {
    let path = dir.join("metrics.jsonl");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|v| v["kind"] == "train")
        .skip(skip)
        .collect())
}

/// One training process: the recipe (tiny by default) for `steps` steps with the overrides
/// `sets` (all its ranks as threads, or this process's rank of a launched job), on `threads`
/// compute threads.
pub fn worker(args: WorkerArgs) -> anyhow::Result<()> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads)
        .build_global()?;
    let mut overrides = vec![
        format!("run.dir={:?}", args.dir.display().to_string()),
        format!("train.max_steps={}", args.steps),
        "train.eval_every=0".into(),
        "checkpoint.every=0".into(),
        "run.log_every=1000000".into(),
        format!("parallel.transport={:?}", args.transport),
    ];
    overrides.extend(args.sets);
    let config = RunConfig::load(None, &overrides)?;
    wildfire_recipes::train::run::<Autodiff<CpuBackend>>(
        config,
        wildfire_recipes::train::Start::Fresh,
    )?;
    Ok(())
}
