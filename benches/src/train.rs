//! `train`: training throughput of the recipe's tiny GPT on the CPU backend (batch 16, context
//! 128, vocab 65, AdamW, global clipping), at 1 and 2 threads, with the step split into forward,
//! backward and optimizer (clipping included). Each thread count runs in its own process (the
//! thread pool is sized once per process); with `--pytorch`, the PyTorch eager reference
//! (`benches/reference/train_tiny.py`) runs the same model in alternating rounds, side by side;
//! with `--reference-ops`, so does wildfire with the fused ops' reference in Burn ops in place
//! of their native loops on Flex; with `--wgpu`, so does wildfire on `Parallel<FusedWgpu>` (Mesa's
//! lavapipe on a machine without a GPU, its threads set by `LP_NUM_THREADS`); with `--llama`,
//! so does the Llama model of the same size (`llama-tiny`: the same 12·d² weights per block,
//! SwiGLU, rotary embeddings, grouped-query attention, untied head), and with `--pytorch` too
//! PyTorch eager's llama-tiny (`train_tiny.py --model llama-tiny`).

use crate::median;
use std::path::Path;
use std::process::Command;
use std::time::Instant;
use wildfire_backend::kernels::probe;
use wildfire_backend::{DecoratedBackend, Parallel};
use wildfire_recipes::CpuBackend;

use anyhow::{Context, bail};
use burn::backend::Autodiff;
use burn::optim::GradientsParams;
use burn::optim::Optimizer;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use clap::Args;
use serde::{Deserialize, Serialize};
use wildfire_backend::device::FusedWgpu;
use wildfire_parallel::clip::clip_global_norm;
use wildfire_recipes::config::TrainSection;
use wildfire_recipes::data::SplitMix64;
use wildfire_recipes::model::{Gpt, Preset, StageSpec, cross_entropy_sum};
use wildfire_recipes::optim::MatrixDecayAdamW;

const VOCAB: usize = 65;
const BATCH: usize = 16;

#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Print one JSON object per line instead of the table.
    #[arg(long)]
    json: bool,
    /// Alternating rounds per thread count.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..))]
    rounds: u16,
    /// Timed steps per round (after 3 warm-up steps).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u16).range(1..))]
    steps: u16,
    /// Also run the PyTorch eager reference (needs python3 with torch).
    #[arg(long)]
    pytorch: bool,
    /// Also run wildfire with the fused ops' reference in Burn ops (`WILDFIRE_KERNELS=reference`)
    /// in place of their native loops on Flex (the ops' `flex` modules in `kernels`).
    #[arg(long)]
    reference_ops: bool,
    /// Also run wildfire on wgpu (`Parallel<FusedWgpu>`, as `--device wgpu`; lavapipe where there
    /// is no GPU).
    #[arg(long)]
    wgpu: bool,
    /// Also run the llama-tiny model on the CPU.
    #[arg(long)]
    llama: bool,
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    threads: u16,
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    steps: u16,
    /// `cpu` (`Parallel<Flex>`) or `wgpu` (`Parallel<FusedWgpu>`).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "wgpu"])]
    device: String,
    /// `tiny` or `llama-tiny`.
    #[arg(long, value_enum, default_value = "tiny")]
    preset: Preset,
}

/// Median per-step times of one process, in milliseconds.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Sample {
    system: String,
    threads: usize,
    step_ms: f64,
    forward_ms: Option<f64>,
    backward_ms: Option<f64>,
    optimizer_ms: Option<f64>,
    tokens_per_sec: f64,
}

fn train_config() -> TrainSection {
    TrainSection {
        seed: 0,
        max_steps: 1000,
        micro_batch: BATCH,
        grad_accum: 1,
        global_batch: None,
        lr: 1e-3,
        min_lr: 1e-4,
        warmup_steps: 0,
        weight_decay: 0.1,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        grad_clip: 1.0,
        eval_every: 0,
        eval_batches: 0,
        activation_checkpointing: Default::default(),
        fused_ops: Some(true),
        fused: Default::default(),
    }
}

/// Runs `steps` timed steps (after 3 warm-up steps) in this process, on the worker's device,
/// and prints a [`Sample`].
pub fn worker(args: WorkerArgs) -> anyhow::Result<()> {
    wildfire_recipes::alloc::keep_freed_memory();
    rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads.into())
        .build_global()?;
    match args.device.as_str() {
        "wgpu" => {
            let device = probe::wgpu().map_err(anyhow::Error::msg)?;
            worker_on::<Autodiff<Parallel<FusedWgpu>>>(args, device, "wildfire-wgpu")
        }
        _ => worker_on::<Autodiff<CpuBackend>>(args, Default::default(), "wildfire"),
    }
}

fn worker_on<B: AutodiffBackend + DecoratedBackend>(
    args: WorkerArgs,
    device: B::Device,
    system: &str,
) -> anyhow::Result<()> {
    B::seed(&device, 0);
    let config = args.preset.config(VOCAB);
    let mut model = Gpt::<B>::new(&config, StageSpec::whole(&config), &device);
    let mut optimizer = OptimizerAdaptor::from(MatrixDecayAdamW::new(&train_config(), true));
    let mut rng = SplitMix64::new(1);
    let context = config.context;
    let tokens: Vec<i64> = (0..BATCH * (context + 1))
        .map(|_| rng.below(VOCAB as u64) as i64)
        .collect();
    let all =
        Tensor::<B, 2, Int>::from_data(TensorData::new(tokens, [BATCH, context + 1]), &device);
    let inputs = all.clone().slice([0..BATCH, 0..context]);
    let targets = all.slice([0..BATCH, 1..context + 1]);
    let (mut forward, mut backward, mut optim, mut total) = (vec![], vec![], vec![], vec![]);
    for step in 0..usize::from(args.steps) + 3 {
        let start = Instant::now();
        let (loss, tokens) = cross_entropy_sum(model.forward(inputs.clone()), targets.clone());
        let loss = loss / tokens as f64;
        let _ = loss.clone().into_data();
        let forwarded = Instant::now();
        let grads = loss.backward();
        let backwarded = Instant::now();
        let mut grads = GradientsParams::from_grads(grads, &model);
        clip_global_norm(&model, &mut grads, 1.0);
        model = optimizer.step(1e-3, model, grads);
        let _ = model.blocks[0].attn.c_proj.weight.val().into_data();
        let done = Instant::now();
        if step >= 3 {
            forward.push((forwarded - start).as_secs_f64() * 1e3);
            backward.push((backwarded - forwarded).as_secs_f64() * 1e3);
            optim.push((done - backwarded).as_secs_f64() * 1e3);
            total.push((done - start).as_secs_f64() * 1e3);
        }
    }
    let step_ms = median(&mut total);
    let sample = Sample {
        system: system.into(),
        threads: args.threads.into(),
        step_ms,
        forward_ms: Some(median(&mut forward)),
        backward_ms: Some(median(&mut backward)),
        optimizer_ms: Some(median(&mut optim)),
        tokens_per_sec: (BATCH * context) as f64 / (step_ms / 1e3),
    };
    println!("{}", serde_json::to_string(&sample)?);
    Ok(())
}

fn last_json_line(output: std::process::Output, what: &str) -> anyhow::Result<Sample> {
    if !output.status.success() {
        bail!(
            "{what} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .context("no JSON line in output")?;
    let mut sample: Sample =
        serde_json::from_str(line).with_context(|| format!("{what} printed {line}"))?;
    sample.system = sample.system.split('+').next().unwrap_or("").to_string();
    Ok(sample)
}

/// The name of wildfire's runs with the fused ops' reference.
const WILDFIRE_REFERENCE_OPS: &str = "wildfire-reference-ops";
/// The name of wildfire's runs of llama-tiny.
const WILDFIRE_LLAMA: &str = "wildfire-llama";
/// The name of PyTorch's runs of llama-tiny.
const PYTORCH_LLAMA: &str = "pytorch-llama";

/// What a worker process runs: wildfire on the CPU, with the fused ops' reference in Burn ops
/// in place of their native loops, on wgpu, or llama-tiny on the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Cpu,
    CpuReferenceOps,
    Wgpu,
    CpuLlama,
}

/// A worker process's sample of `variant`.
fn run_wildfire(threads: usize, steps: usize, variant: Variant) -> anyhow::Result<Sample> {
    let exe = std::env::current_exe()?;
    let mut command = Command::new(exe);
    let reference_ops = variant == Variant::CpuReferenceOps;
    if reference_ops {
        command.env("WILDFIRE_KERNELS", "reference");
    }
    let device = if variant == Variant::Wgpu {
        command.env("LP_NUM_THREADS", threads.to_string());
        "wgpu"
    } else {
        "cpu"
    };
    let output = command
        .args([
            "train-worker",
            "--threads",
            &threads.to_string(),
            "--steps",
            &steps.to_string(),
            "--device",
            device,
            "--preset",
            if variant == Variant::CpuLlama {
                "llama-tiny"
            } else {
                "tiny"
            },
        ])
        .output()?;
    let mut sample = last_json_line(output, "wildfire train worker")?;
    match variant {
        Variant::CpuReferenceOps => sample.system = WILDFIRE_REFERENCE_OPS.into(),
        Variant::CpuLlama => sample.system = WILDFIRE_LLAMA.into(),
        Variant::Cpu | Variant::Wgpu => {}
    }
    Ok(sample)
}

/// The PyTorch eager reference's sample of `model` (`tiny` or `llama-tiny`), named `system`.
fn run_pytorch(threads: usize, steps: usize, model: &str, system: &str) -> anyhow::Result<Sample> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("reference/train_tiny.py");
    let output = Command::new("python3")
        .arg(&script)
        .args([
            "--threads",
            &threads.to_string(),
            "--steps",
            &steps.to_string(),
            "--warmup",
            "3",
            "--model",
            model,
        ])
        .output()
        .context("running python3 (is it installed?)")?;
    let mut sample = last_json_line(output, "PyTorch reference")?;
    sample.system = system.into();
    Ok(sample)
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let mut samples: Vec<Sample> = Vec::new();
    for round in 0..args.rounds {
        for threads in [1, 2] {
            let variants = [
                Some(Variant::Cpu),
                args.reference_ops.then_some(Variant::CpuReferenceOps),
                args.wgpu.then_some(Variant::Wgpu),
                args.llama.then_some(Variant::CpuLlama),
            ];
            for variant in variants.into_iter().flatten() {
                let sample = run_wildfire(threads, args.steps.into(), variant)?;
                emit(&sample, round, args.json)?;
                samples.push(sample);
            }
            let references = [
                args.pytorch.then_some(("tiny", "pytorch")),
                (args.pytorch && args.llama).then_some(("llama-tiny", PYTORCH_LLAMA)),
            ];
            for (model, system) in references.into_iter().flatten() {
                let sample = run_pytorch(threads, args.steps.into(), model, system)?;
                emit(&sample, round, args.json)?;
                samples.push(sample);
            }
        }
    }
    if !args.json {
        summarise(&samples, &args);
    }
    Ok(())
}

fn emit(sample: &Sample, round: u16, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(sample)?);
    } else {
        let phase = |v: Option<f64>| v.map_or("-".to_string(), |ms| format!("{ms:.1}"));
        println!(
            "round {round} {:<22} threads {} | step {:7.1} ms | fwd {:>6} | bwd {:>6} | optim {:>6} | {:8.0} tok/s",
            sample.system,
            sample.threads,
            sample.step_ms,
            phase(sample.forward_ms),
            phase(sample.backward_ms),
            phase(sample.optimizer_ms),
            sample.tokens_per_sec
        );
    }
    Ok(())
}

/// Median tokens/s of `system`'s runs at `threads` threads, over the rounds.
fn median_tokens_per_sec(samples: &[Sample], system: &str, threads: usize) -> f64 {
    let mut values: Vec<f64> = samples
        .iter()
        .filter(|s| s.system == system && s.threads == threads)
        .map(|s| s.tokens_per_sec)
        .collect();
    median(&mut values)
}

fn summarise(samples: &[Sample], args: &TrainArgs) {
    for threads in [1, 2] {
        let ours = median_tokens_per_sec(samples, "wildfire", threads);
        if args.wgpu {
            let wgpu = median_tokens_per_sec(samples, "wildfire-wgpu", threads);
            println!(
                "threads {threads}: wildfire on wgpu {wgpu:.0} tok/s, on cpu {ours:.0} tok/s, \
                 ratio {:.3}",
                wgpu / ours
            );
        }
        if args.llama {
            let llama = median_tokens_per_sec(samples, WILDFIRE_LLAMA, threads);
            println!(
                "threads {threads}: llama-tiny {llama:.0} tok/s, the tiny GPT {ours:.0} tok/s, \
                 ratio {:.3}",
                llama / ours
            );
            if args.pytorch {
                let theirs = median_tokens_per_sec(samples, PYTORCH_LLAMA, threads);
                println!(
                    "threads {threads}: llama-tiny: wildfire {llama:.0} tok/s, PyTorch \
                     {theirs:.0} tok/s, ratio {:.2}",
                    llama / theirs
                );
            }
        }
        if args.reference_ops {
            let reference = median_tokens_per_sec(samples, WILDFIRE_REFERENCE_OPS, threads);
            println!(
                "threads {threads}: fused ops' native loops {ours:.0} tok/s, their reference in \
                 Burn ops {reference:.0} tok/s, speedup {:.2}",
                ours / reference
            );
        }
        if args.pytorch {
            let theirs = median_tokens_per_sec(samples, "pytorch", threads);
            println!(
                "threads {threads}: wildfire {ours:.0} tok/s, PyTorch {theirs:.0} tok/s, ratio {:.2}",
                ours / theirs
            );
        } else {
            println!("threads {threads}: wildfire {ours:.0} tok/s");
        }
    }
}
