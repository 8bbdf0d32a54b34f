//! `activations`: peak memory and step time of training under each activation-checkpointing
//! mode (none, full, selective), and without checkpointing on the decomposed ops instead of
//! the fused ones, on the tiny, llama-tiny and gpt2 presets, measured side by side in one
//! process by the counting allocator: the run's `activation_peak_mib` metric (the peak heap
//! growth during a step's forwards and backwards: kept activations, the backward's transients
//! and the gradients), and the whole run's peak heap (which on a large model is set by the model
//! state and the optimizer, not by the activations).

use anyhow::Context;
use clap::Args;
use serde::Serialize;
use wildfire_recipes::config::{ActivationCheckpointing, RunConfig};

use crate::alloc::HEAP;
use crate::dp::train_records;
use crate::{median, mib, print_json_lines};

#[derive(Debug, Args)]
pub struct ActivationArgs {
    /// Print one JSON object per line instead of the table.
    #[arg(long)]
    json: bool,
    /// Training steps per measurement (the first, which allocates AdamW's moments, is not
    /// timed).
    #[arg(long, default_value_t = 4)]
    steps: u64,
    /// Only these presets (repeatable; default: all of them).
    #[arg(long = "preset", value_name = "PRESET")]
    presets: Vec<String>,
}

/// The measurements of each shape: every checkpointing mode with the fused ops (the default),
/// then no checkpointing with the decomposed ops (`train.fused_ops = false`), which shows what
/// the fused ops' backward keeps less of.
const RUNS: [(ActivationCheckpointing, bool); 4] = [
    (ActivationCheckpointing::None, true),
    (ActivationCheckpointing::Full, true),
    (ActivationCheckpointing::Selective, true),
    (ActivationCheckpointing::None, false),
];

#[derive(Debug, Serialize)]
struct Row {
    preset: &'static str,
    context: usize,
    micro_batch: usize,
    mode: String,
    /// Heap growth at its peak over the run (model built, trained, checkpoint-free).
    run_peak_mib: f64,
    /// Median over the steps after the first of the run's `activation_peak_mib`.
    activation_peak_mib: f64,
    /// Median step time after the first step.
    step_ms: f64,
    /// activation_peak_mib / that of `none`.
    memory_ratio: f64,
    /// step_ms / that of `none`.
    time_ratio: f64,
}

/// (preset, context, micro-batch).
const SHAPES: [(&str, usize, usize); 3] =
    [("tiny", 128, 16), ("llama-tiny", 128, 16), ("gpt2", 256, 4)];

pub fn run(args: ActivationArgs) -> anyhow::Result<()> {
    wildfire_recipes::alloc::register(&HEAP);
    let mut rows = Vec::new();
    for (preset, context, micro_batch) in SHAPES {
        if !args.presets.is_empty() && !args.presets.iter().any(|p| p == preset) {
            continue;
        }
        let first = rows.len();
        for (mode, fused_ops) in RUNS {
            let row = measure(preset, context, micro_batch, mode, fused_ops, args.steps)?;
            rows.push(row);
        }
        let (memory, time) = (rows[first].activation_peak_mib, rows[first].step_ms);
        for row in &mut rows[first..] {
            row.memory_ratio = row.activation_peak_mib / memory;
            row.time_ratio = row.step_ms / time;
        }
    }
    if args.json {
        return print_json_lines(&rows);
    }
    println!(
        "| preset | context × micro-batch | mode | forward+backward peak | × none | run peak | step | × none |\n|---|---|---|---|---|---|---|---|"
    );
    for row in &rows {
        println!(
            "| {} | {} × {} | {} | {:.1} MiB | {:.2} | {:.1} MiB | {:.0} ms | {:.2} |",
            row.preset,
            row.context,
            row.micro_batch,
            row.mode,
            row.activation_peak_mib,
            row.memory_ratio,
            row.run_peak_mib,
            row.step_ms,
            row.time_ratio
        );
    }
    Ok(())
}

fn measure(
    preset: &'static str,
    context: usize,
    micro_batch: usize,
    mode: ActivationCheckpointing,
    fused_ops: bool,
    steps: u64,
) -> anyhow::Result<Row> {
    let dir = std::env::temp_dir().join(format!(
        "wildfire-activations-bench-{}-{preset}-{mode}-{fused_ops}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let overrides = [
        format!("run.dir={:?}", dir.display().to_string()),
        format!("model.preset={preset:?}"),
        format!("model.context={context}"),
        format!("train.micro_batch={micro_batch}"),
        format!("train.max_steps={steps}"),
        "train.eval_every=0".into(),
        "checkpoint.every=0".into(),
        "run.log_every=1000000".into(),
        format!("train.activation_checkpointing={:?}", mode.to_string()),
        format!("train.fused_ops={fused_ops}"),
    ];
    let config = RunConfig::load(None, &overrides)?;
    let before = HEAP.current();
    HEAP.reset_peak();
    wildfire_recipes::train::run_on_device(config, wildfire_recipes::train::Start::Fresh)?;
    let run_peak_mib = mib(HEAP.peak().saturating_sub(before));
    // Step 0 also allocates AdamW's moments.
    let records = train_records(&dir, 1)?;
    let series = |key: &str| -> anyhow::Result<f64> {
        let mut values = records
            .iter()
            .map(|record| record[key].as_f64())
            .collect::<Option<Vec<f64>>>()
            .with_context(|| format!("{key} missing from {}", dir.display()))?;
        Ok(median(&mut values))
    };
    let (step_ms, activation_peak_mib) = (series("step_time_ms")?, series("activation_peak_mib")?);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Row {
        preset,
        context,
        micro_batch,
        mode: match fused_ops {
            true => mode.to_string(),
            false => format!("{mode}, decomposed ops"),
        },
        run_peak_mib,
        activation_peak_mib,
        step_ms,
        memory_ratio: 1.0,
        time_ratio: 1.0,
    })
}
