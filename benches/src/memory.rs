//! `memory`: the bytes one data-parallel rank holds for its model state (parameters, gradients,
//! AdamW moments) under ZeRO stages 0–3 at dp = 1, 2 and 4 on the gpt2 preset, measured by the
//! counting allocator while the states are built (no training), next to the optimizer's own
//! accounting; then the peak heap of a few training steps of the tiny model at dp = 2 (ranks as
//! threads) per stage.

use crate::{mib, print_json_lines};
use std::collections::HashMap;
use std::time::Duration;
use wildfire_recipes::CpuBackend;

use anyhow::Context;
use burn::backend::Autodiff;
use burn::module::ParamId;
use burn::tensor::Tensor;
use clap::Args;
use serde::Serialize;
use wildfire_backend::comm::{CommOptions, ProcessGroup, split_ranges};
use wildfire_parallel::dp::{self, DEFAULT_BUCKET_BYTES, FlatLayout};
use wildfire_parallel::fsdp::{FullMoments, ZeroOptimizer, ZeroStage};
use wildfire_recipes::config::RunConfig;
use wildfire_recipes::model::{Gpt, Preset, StageSpec};
use wildfire_recipes::optim::MatrixDecayAdamW;

use crate::alloc::HEAP;

type B = Autodiff<CpuBackend>;

const STAGES: [ZeroStage; 4] = [
    ZeroStage::Replicated,
    ZeroStage::ShardOptimizer,
    ZeroStage::ShardGradients,
    ZeroStage::ShardParameters,
];

#[derive(Debug, Args)]
pub struct MemoryArgs {
    /// Print one JSON object per line instead of the tables.
    #[arg(long)]
    json: bool,
    /// Skip the training-step peaks (tiny model).
    #[arg(long)]
    no_step: bool,
}

/// Model-state bytes of rank 0 under one layout.
#[derive(Debug, Serialize)]
struct StateRow {
    preset: &'static str,
    dp: usize,
    zero: u8,
    /// Heap growth while the rank's state was built (plus the replicated parameters).
    measured_bytes: usize,
    /// The optimizer's accounting: parameters + gradients + moments.
    accounted_bytes: usize,
    params_bytes: usize,
    grads_bytes: usize,
    optimizer_bytes: usize,
    /// measured / measured of ZeRO 0 at the same dp.
    ratio_to_zero0: f64,
}

/// Peak heap growth of a short training run.
#[derive(Debug, Serialize)]
struct StepRow {
    preset: &'static str,
    dp: usize,
    zero: u8,
    steps: u64,
    peak_bytes: usize,
}

pub fn run(args: MemoryArgs) -> anyhow::Result<()> {
    HEAP.enable();
    let rows = model_states()?;
    print_states(&rows, args.json)?;
    if !args.no_step {
        let steps = step_peaks()?;
        print_steps(&steps, args.json)?;
    }
    Ok(())
}

/// Builds rank 0's state for every (dp, stage) on the gpt2 preset and measures it.
fn model_states() -> anyhow::Result<Vec<StateRow>> {
    let config = Preset::Gpt2.config(50257);
    let device = Default::default();
    let before = HEAP.current();
    let model = Gpt::<B>::new(&config, StageSpec::whole(&config), &device);
    let model_bytes = HEAP.current() - before;
    let layout = FlatLayout::of_module(&model, DEFAULT_BUCKET_BYTES);
    let params = dp::flat_params(&model);
    // Restoring zero moments builds the moment state as training would after one step.
    let moments: HashMap<ParamId, FullMoments<CpuBackend>> = params
        .iter()
        .map(|(id, value)| {
            let zeros = || Tensor::<CpuBackend, 1>::zeros(value.shape(), &device);
            let moments = FullMoments {
                exp_avg: zeros(),
                exp_avg_sq: zeros(),
                time: 1,
            };
            (*id, moments)
        })
        .collect();
    let halves = MatrixDecayAdamW::new(&RunConfig::load(None, &[])?.train, true).halves();
    let mut rows = Vec::new();
    for dp in [1, 2, 4] {
        let options = CommOptions {
            timeout: Duration::from_secs(60),
            debug: false,
        };
        let group = ProcessGroup::local_world(dp, options)?
            .into_iter()
            .next()
            .context("a rank")?;
        let mut zero0 = None;
        for stage in STAGES {
            let start = HEAP.current();
            let mut zero = ZeroOptimizer::<CpuBackend>::new(
                stage,
                group.clone(),
                layout.clone(),
                halves.clone(),
                false,
                device,
            );
            zero.set_params(&params);
            zero.set_moments(&moments)?;
            let grads = gradient_buffers(&layout, stage, dp);
            let built = HEAP.current() - start;
            let replicated = if stage == ZeroStage::ShardParameters {
                0
            } else {
                model_bytes
            };
            let measured = built + replicated;
            let accounted = zero.state_bytes();
            let baseline = *zero0.get_or_insert(measured);
            rows.push(StateRow {
                preset: "gpt2",
                dp,
                zero: stage.level(),
                measured_bytes: measured,
                accounted_bytes: accounted.device_total(),
                params_bytes: accounted.params,
                grads_bytes: accounted.grads,
                optimizer_bytes: accounted.optimizer_device,
                ratio_to_zero0: measured as f64 / baseline as f64,
            });
            drop((zero, grads));
        }
    }
    Ok(rows)
}

/// The gradient buffers rank 0 keeps between backward and update: whole buckets under ZeRO 0
/// and 1, its owned parts under 2 and 3.
fn gradient_buffers(
    layout: &FlatLayout,
    stage: ZeroStage,
    dp: usize,
) -> Vec<Tensor<CpuBackend, 1>> {
    layout
        .buckets
        .iter()
        .map(|bucket| {
            let len = match stage {
                ZeroStage::Replicated | ZeroStage::ShardOptimizer => bucket.numel,
                _ => split_ranges(bucket.numel, dp)[0].len(),
            };
            Tensor::zeros([len], &Default::default())
        })
        .collect()
}

/// Peak heap growth of 3 steps of the tiny model at dp = 2 (thread ranks), per stage, and of
/// serial training for reference.
fn step_peaks() -> anyhow::Result<Vec<StepRow>> {
    let mut rows = Vec::new();
    let layouts = [(1, ZeroStage::Replicated)]
        .into_iter()
        .chain(STAGES.into_iter().map(|stage| (2, stage)));
    for (dp, stage) in layouts {
        let dir = std::env::temp_dir().join(format!(
            "wildfire-memory-bench-{}-{dp}-{}",
            std::process::id(),
            stage.level()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let overrides = [
            format!("run.dir={:?}", dir.display().to_string()),
            "train.max_steps=3".into(),
            "train.eval_every=0".into(),
            "checkpoint.every=0".into(),
            "run.log_every=1000000".into(),
            format!("parallel.dp={dp}"),
            format!("parallel.zero={}", stage.level()),
            "parallel.transport=\"local\"".into(),
        ];
        let config = RunConfig::load(None, &overrides)?;
        let before = HEAP.current();
        HEAP.reset_peak();
        wildfire_recipes::train::run::<B>(config, wildfire_recipes::train::Start::Fresh)?;
        rows.push(StepRow {
            preset: "tiny",
            dp,
            zero: stage.level(),
            steps: 3,
            peak_bytes: HEAP.peak().saturating_sub(before),
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(rows)
}

fn print_states(rows: &[StateRow], json: bool) -> anyhow::Result<()> {
    if json {
        return print_json_lines(rows);
    }
    println!("model state of rank 0, gpt2 preset (124,439,808 parameters, f32, AdamW):");
    println!(
        "| dp | ZeRO | measured | accounted (params + grads + moments) | × ZeRO 0 |\n|---|---|---|---|---|"
    );
    for row in rows {
        println!(
            "| {} | {} | {:.1} MiB | {:.1} MiB ({:.1} + {:.1} + {:.1}) | {:.3} |",
            row.dp,
            row.zero,
            mib(row.measured_bytes),
            mib(row.accounted_bytes),
            mib(row.params_bytes),
            mib(row.grads_bytes),
            mib(row.optimizer_bytes),
            row.ratio_to_zero0
        );
    }
    Ok(())
}

fn print_steps(rows: &[StepRow], json: bool) -> anyhow::Result<()> {
    if json {
        return print_json_lines(rows);
    }
    println!("\npeak heap growth of 3 training steps, tiny preset, every rank of the process:");
    println!("| dp | ZeRO | peak |\n|---|---|---|");
    for row in rows {
        println!(
            "| {} | {} | {:.1} MiB |",
            row.dp,
            row.zero,
            mib(row.peak_bytes)
        );
    }
    Ok(())
}
