//! Steps trained but not yet logged. A step leaves its loss and its gradient norm on the device,
//! so the host never waits for the device inside a step and a GPU can run ahead. Every
//! `run.log_every` steps, and before an evaluation or a checkpoint, the loop closes the
//! interval: it reads every pending value in one blocking read and logs those steps.
//!
//! Throughput is measured over the interval, which ends with that read: the one point where the
//! host knows the device has done the interval's work (a step's own host time says only how long
//! queueing its kernels took). Every step of an interval shows the interval's tokens per second.

use std::time::Instant;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use wildfire_parallel::device_value::read_values;
use wildfire_parallel::pp::PipelineReport;

use crate::logging::StepOutput;

/// A step whose loss and gradient norm are still on the device.
#[derive(Debug)]
pub struct PendingStep<B: Backend> {
    pub step: u64,
    pub lr: f64,
    /// Σ token losses of the step over every data-parallel replica.
    pub loss_sum: Tensor<B, 1>,
    /// The global gradient norm before clipping (not finite when a gradient overflowed).
    pub grad_norm: Tensor<B, 1>,
    /// Whether fp16's loss scaling skipped the step.
    pub skipped: bool,
    /// What the host knows already: tokens, communication time, loss scale, memory.
    pub output: StepOutput,
    pub pipeline: Option<PipelineReport>,
    /// Blocking reads this rank's thread made during the step (see
    /// `wildfire_backend::blocking_reads`).
    pub host_reads: u64,
}

/// A step as logged: its numbers, and its pipeline measurements.
#[derive(Debug)]
pub struct LoggedStep {
    pub step: u64,
    pub lr: f64,
    pub output: StepOutput,
    pub pipeline: Option<PipelineReport>,
    pub host_reads: u64,
}

/// The steps of the current log interval, and when it started.
#[derive(Debug)]
pub struct Interval<B: Backend> {
    pending: Vec<PendingStep<B>>,
    started: Instant,
}

impl<B: Backend> Default for Interval<B> {
    fn default() -> Self {
        Self {
            pending: Vec::new(),
            started: Instant::now(),
        }
    }
}

impl<B: Backend> Interval<B> {
    pub fn push(&mut self, step: PendingStep<B>) {
        self.pending.push(step);
    }

    /// The next interval starts now (after an evaluation or a checkpoint, whose time is not
    /// training time).
    pub fn restart(&mut self) {
        self.started = Instant::now();
    }

    /// Reads the pending steps' losses and norms (one blocking read) and returns them logged:
    /// mean loss per token, gradient norm (∞ for a skipped step), and the interval's tokens
    /// per second; `mfu` turns tokens per second into model FLOPs utilisation. Starts the next
    /// interval.
    pub fn close(&mut self, mfu: impl Fn(f64) -> Option<f64>) -> Vec<LoggedStep> {
        let pending = std::mem::take(&mut self.pending);
        let values = read_values(
            pending
                .iter()
                .flat_map(|p| [p.loss_sum.clone(), p.grad_norm.clone()])
                .collect(),
        );
        let seconds = self.started.elapsed().as_secs_f64();
        self.restart();
        let tokens: usize = pending.iter().map(|p| p.output.tokens).sum();
        let tokens_per_sec = tokens as f64 / seconds;
        pending
            .into_iter()
            .zip(values.chunks(2))
            .map(|(p, values)| {
                let (loss_sum, grad_norm) = (values[0], values[1]);
                let output = StepOutput {
                    loss_sum,
                    step_loss: Some(loss_sum / p.output.tokens as f64),
                    grad_norm: Some(if p.skipped { f64::INFINITY } else { grad_norm }),
                    tokens_per_sec: Some(tokens_per_sec),
                    mfu: mfu(tokens_per_sec),
                    ..p.output
                };
                LoggedStep {
                    step: p.step,
                    lr: p.lr,
                    output,
                    pipeline: p.pipeline,
                    host_reads: p.host_reads,
                }
            })
            .collect()
    }
}
