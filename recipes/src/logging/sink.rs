//! The run's metric files: `metrics.jsonl` (one JSON object per logged step or evaluation) and a
//! TensorBoard event file, written from the training loop with the global step as x-axis.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::Context;
use serde::Serialize;
use wildfire_parallel::pp::PipelineReport;

use super::tensorboard::EventWriter;

/// One optimizer step's numbers.
#[derive(Debug, Clone, Serialize)]
pub struct StepRecord {
    pub step: u64,
    /// Mean loss per token over the step's micro-batches.
    pub loss: f64,
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub tokens_per_sec: f64,
    /// Model FLOPs utilisation in [0, 1]; absent when the device peak is unknown.
    pub mfu: Option<f64>,
    pub step_time_ms: f64,
    /// Time rank 0 spent in the data-parallel gradient reduction (and, under ZeRO 3, in the
    /// parameter all-gathers of the forward and backward; the all-gather that follows a ZeRO
    /// 1/2 update is not counted), plus its tensor-parallel collectives (those inside the
    /// forwards and backwards, and the sequence-parallel gradient sums).
    pub comm_ms: f64,
    /// Blocking reads of device values rank 0's thread made during the step
    /// (`wildfire_backend::blocking_reads`: collectives' transfers and the reads of the log
    /// interval not counted): 0 when the device can run ahead of the host, 1 under fp16 (the
    /// overflow check).
    pub host_reads: u64,
    /// fp16's loss scaling, in fp16 runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<LossScaleRecord>,
    /// The peak heap growth of rank 0's process during the step's forwards and backwards, in
    /// MiB: the activations kept for the backward, the backward's transients and the
    /// gradients (with ranks as threads, every rank of the process). Present when the process
    /// counts its heap (the `wildfire` binary does, see `alloc::register`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation_peak_mib: Option<f64>,
    /// Pipeline measurements, when the run has more than one stage.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineReport>,
}

/// fp16's dynamic loss scaling in one step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LossScaleRecord {
    /// The scale `S` the step's loss was multiplied by before its backward.
    pub scale: f64,
    /// Whether a gradient overflowed, so the step was skipped (parameters and optimizer state
    /// unchanged) and the scale halved.
    pub skipped: bool,
    /// Steps skipped so far in the run.
    pub skipped_steps: u64,
}

/// Appends metrics to `metrics.jsonl` and to the TensorBoard event file of a run directory.
#[derive(Debug)]
pub struct MetricsSink {
    jsonl: BufWriter<File>,
    events: EventWriter,
}

impl MetricsSink {
    /// Opens the sink in `run_dir` and records `config_toml` as the run's `config` text. A run
    /// resumed at `step` continues `metrics.jsonl`, first dropping the records of steps it is
    /// about to redo (those the interrupted run logged after its last checkpoint).
    pub fn open(run_dir: &Path, config_toml: &str, step: u64) -> anyhow::Result<Self> {
        let path = run_dir.join("metrics.jsonl");
        if path.exists() {
            keep_records_before(&path, step)?;
        }
        if step == 0 {
            // A run started again from its beginning redoes every step its events recorded.
            remove_event_files(run_dir)?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        let mut events = EventWriter::create(run_dir).with_context(|| {
            format!(
                "cannot create a TensorBoard event file in {}",
                run_dir.display()
            )
        })?;
        // Fenced, so TensorBoard's markdown view keeps the TOML's lines.
        events.add_text(
            "config",
            &format!("```toml\n{config_toml}\n```"),
            step as i64,
        )?;
        Ok(Self {
            jsonl: BufWriter::new(file),
            events,
        })
    }

    pub fn log_step(&mut self, record: &StepRecord) -> anyhow::Result<()> {
        let step = record.step as i64;
        self.events
            .add_scalar("train/loss", record.loss as f32, step)?;
        self.events.add_scalar("train/lr", record.lr as f32, step)?;
        self.events
            .add_scalar("train/grad_norm", record.grad_norm as f32, step)?;
        self.events
            .add_scalar("train/tokens_per_sec", record.tokens_per_sec as f32, step)?;
        if let Some(mfu) = record.mfu {
            self.events.add_scalar("train/mfu", mfu as f32, step)?;
        }
        if let Some(peak) = record.activation_peak_mib {
            self.events
                .add_scalar("memory/activation_peak_mib", peak as f32, step)?;
        }
        if let Some(scaling) = &record.loss_scale {
            self.events
                .add_scalar("train/loss_scale", scaling.scale as f32, step)?;
            self.events
                .add_scalar("train/skipped_steps", scaling.skipped_steps as f32, step)?;
        }
        if let Some(pipeline) = &record.pipeline {
            self.events.add_scalar(
                "pipeline/bubble_theory",
                pipeline.bubble_theory as f32,
                step,
            )?;
            for (rank, (bubble, peak)) in pipeline
                .bubble
                .iter()
                .zip(&pipeline.peak_activations)
                .enumerate()
            {
                let (bubble_tag, peak_tag) = (
                    format!("pipeline/bubble/rank{rank}"),
                    format!("pipeline/peak_activations/rank{rank}"),
                );
                self.events.add_scalar(&bubble_tag, *bubble as f32, step)?;
                self.events.add_scalar(&peak_tag, *peak as f32, step)?;
            }
        }
        let mut line = serde_json::to_value(record)?;
        line["kind"] = "train".into();
        self.write_line(&line)
    }

    pub fn log_eval(&mut self, step: u64, val_loss: f64) -> anyhow::Result<()> {
        self.events
            .add_scalar("val/loss", val_loss as f32, step as i64)?;
        self.write_line(&serde_json::json!({ "kind": "eval", "step": step, "val_loss": val_loss }))
    }

    fn write_line(&mut self, value: &serde_json::Value) -> anyhow::Result<()> {
        serde_json::to_writer(&mut self.jsonl, value)?;
        self.jsonl.write_all(b"\n")?;
        self.jsonl.flush()?;
        Ok(())
    }
}

/// Rewrites the jsonl file at `path` (atomically: a temporary file, then a rename) without the
/// records that belong to steps `step` and later: training records with `step ≥ step`, and
/// evaluations of weights after more than `step` updates.
fn keep_records_before(path: &Path, step: u64) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let kept: Vec<&str> = text
        .lines()
        .filter(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
            match (record["kind"].as_str(), record["step"].as_u64()) {
                (Some("train"), Some(s)) => s < step,
                (Some("eval"), Some(s)) => s <= step,
                _ => true,
            }
        })
        .collect();
    let temporary = path.with_extension("jsonl.tmp");
    let mut contents = kept.join("\n");
    if !contents.is_empty() {
        contents.push('\n');
    }
    std::fs::write(&temporary, contents)
        .with_context(|| format!("cannot write {}", temporary.display()))?;
    std::fs::rename(&temporary, path)
        .with_context(|| format!("cannot replace {}", path.display()))?;
    Ok(())
}

/// Removes the TensorBoard event files wildfire wrote in `run_dir`.
fn remove_event_files(run_dir: &Path) -> anyhow::Result<()> {
    let Ok(entries) = std::fs::read_dir(run_dir) else {
        return Ok(());
    };
    for entry in entries {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with("events.out.tfevents.") && name.ends_with(".wildfire") {
            std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    Ok(())
}
