//! The training loop: step-based, on burn-train. `run` prepares data, model, optimizer and the
//! run directory; [`StepLoop`] is the burn-train learning strategy that runs the steps:
//!
//! ```text
//! for s in start..max_steps:
//!     reseed the backend RNG from (seed, s)                     # dropout, resumable
//!     draw this data-parallel rank's part of the step's global batch; cut it into grad_accum
//!         micro-batches
//!     run the pipeline schedule over them (or, under ZeRO 3, the sharded units): each
//!         micro-batch's backward starts from (Σ token losses) / (tokens in the global batch)
//!         (`wildfire_parallel::split`, which sums the micro-batches' gradients)
//!     the Learner's optimizer step (`wildfire_parallel::learner_update`): reduce the gradients
//!         over the data-parallel ranks (DDP or ZeRO); clip by the global norm (over every
//!         rank); AdamW step at lr(s)
//!     every log_every steps: read the steps' losses and norms back (the steps themselves
//!         read nothing from the device) and log loss, lr, grad norm, tokens/s, MFU (and the
//!         pipeline's bubble)
//!     every eval_every steps: validation loss; every checkpoint.every steps: checkpoint
//! ```
//!
//! Every run goes through the pipeline executor: without pipeline parallelism the schedule is
//! one stage on one rank (forward, backward, per micro-batch), the same arithmetic as a plain
//! loop. With `parallel.pp > 1` each rank holds its stages' chunks, every rank draws the same
//! batches (the first stage reads the inputs, the last the targets), and the tied embedding's
//! two copies (first and last stage) get the sum of their gradients.

mod batch;
mod interval;
mod setup;
mod update;

pub use crate::optim::{LearnerOptimizer, Optimizers};
pub use batch::{EvalLoader, TokenBatch, TrainLoader};
pub use setup::{Start, TrainOutcome, resume_config, run, run_on_device, start};
pub use update::{counted_elsewhere, zero_layout};

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::data::dataloader::Progress;
use burn::module::Module;
use burn::tensor::Tensor;
use burn::train::EventProcessorTraining;
use burn::train::{
    Learner, LearnerEvent, LearningComponentsMarker, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader as BurnTrainLoader, TrainingComponents,
    TrainingItem, ValidLoader,
};

use anyhow::bail;
use wildfire_backend::comm::ProcessGroup;
use wildfire_parallel::pp::PipelineReport;
use wildfire_parallel::precision::{DynamicLossScaler, StepDecision};
use wildfire_parallel::split::ModelSplit;

use crate::TrainBackend;
use crate::checkpoint::{self, BackgroundWriter, ModuleLayout, TrainState};
use crate::data::{Sampler, SplitMix64};
use crate::logging::{LossScaleRecord, MetricsSink, StepOutput, StepRecord};
use crate::model::GptChunks;
use crate::optim::WarmupCosine;
use wildfire_backend::blocking_reads;
use wildfire_backend::profile::next_table;
use wildfire_parallel::device_value::read_value;
use wildfire_parallel::update::lock;

use interval::{Interval, LoggedStep, PendingStep};

/// burn-train's components for the GPT recipe on backend `B`: the model is the chunks one rank
/// holds.
pub type GptComponents<B> =
    LearningComponentsMarker<B, WarmupCosine, GptChunks<B>, LearnerOptimizer<B>>;

/// The fixed settings of a run's loop.
#[derive(Debug, Clone)]
pub struct LoopSettings {
    pub start_step: u64,
    pub max_steps: u64,
    pub grad_accum: usize,
    pub eval_every: u64,
    /// Steps per log interval: the loop reads the steps' losses and norms back this often.
    pub log_every: u64,
    /// Steps whose kernels are profiled, after the first (`run.profile`), and the file
    /// CubeCL's profiling logger writes (see `wildfire_backend::profile`).
    pub profile_steps: u64,
    pub profile_file: Option<PathBuf>,
    pub checkpoint_every: u64,
    pub keep_last: usize,
    /// Periodic checkpoints are written in the background (see `checkpoint::BackgroundWriter`).
    pub checkpoint_in_background: bool,
    pub seed: u64,
    /// Training FLOPs per token (see `GptConfig::flops_per_token`).
    pub flops_per_token: f64,
    pub peak_flops: Option<f64>,
    /// Data-parallel ranks: the global batch is this many times a rank's.
    pub dp: usize,
}

/// A rank's place in the run: every rank, its data-parallel group, the ranks that hold one
/// model replica between them (pipeline × tensor-parallel), how that replica is split, and
/// where its parameters sit in the whole model.
#[derive(Debug)]
pub struct RankContext {
    pub world: ProcessGroup,
    pub data: ProcessGroup,
    pub replica: ProcessGroup,
    pub split: ModelSplit,
    pub layout: ModuleLayout,
}

/// The step-based learning strategy. burn-train's `Learner` holds the model (the chunks this
/// rank trains; under ZeRO 3, skeletons whose parameters the sharded optimizer holds), its
/// optimizer and the schedule; the loop keeps shared handles to what it checkpoints (the
/// optimizer, the sampler) and the metric files.
pub struct StepLoop<B: TrainBackend> {
    pub settings: LoopSettings,
    /// A handle to the Learner's optimizer.
    pub optimizer: LearnerOptimizer<B>,
    pub sampler: Arc<Mutex<Sampler>>,
    /// fp16's dynamic loss scale (fp16 runs only); every rank keeps the same one.
    pub scaler: Option<Mutex<DynamicLossScaler>>,
    /// Metric files, on rank 0 only.
    pub sink: Option<Mutex<MetricsSink>>,
    /// Checkpoint template: everything but the step-dependent fields.
    pub state: TrainState,
    pub checkpoint_root: PathBuf,
    /// The background checkpoint write in flight, if any.
    pub writer: Mutex<BackgroundWriter>,
    pub rank: RankContext,
    /// The first error of the loop (a checkpoint or a metrics write that failed); the loop
    /// stops at it and `run` returns it.
    pub error: Mutex<Option<anyhow::Error>>,
    /// Per-step mean losses, for the caller.
    pub losses: Mutex<Vec<f64>>,
    /// The steps trained since the last log (see [`interval`]).
    pub interval: Mutex<Interval<B::InnerBackend>>,
    /// How far rank 0 has read the kernel profile (under `run.profile`).
    pub profile_offset: Mutex<usize>,
}

const MIB: f64 = (1 << 20) as f64;

/// How long rank 0 waits for CubeCL's logging thread to write a step's table of kernels.
const PROFILE_WAIT: Duration = Duration::from_secs(60);

/// Model FLOPs utilisation: the job's model FLOP/s (`flops_per_token` × the job's tokens/s)
/// over what its `ranks` devices of `peak` FLOP/s each can do.
pub fn mfu(flops_per_token: f64, tokens_per_sec: f64, ranks: usize, peak: f64) -> f64 {
    flops_per_token * tokens_per_sec / (ranks as f64 * peak)
}

/// The backend seed of step `s`: dropout masks depend only on `(seed, s)`.
pub fn step_seed(seed: u64, step: u64) -> u64 {
    SplitMix64::new(seed ^ step.wrapping_mul(0xD1B5_4A32_D192_ED03)).next_u64()
}

impl<B: TrainBackend> std::fmt::Debug for StepLoop<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepLoop")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl<B: TrainBackend> StepLoop<B> {
    /// One optimizer step (all its micro-batches); returns the numbers it logs, the loss and
    /// the gradient norm still on the device. Under fp16 the update reads the norm back to
    /// decide whether to skip the step; otherwise nothing is read.
    fn step(
        &self,
        learner: &mut Learner<GptComponents<B>>,
        batches: &mut dyn Iterator<Item = TokenBatch<B>>,
        step: u64,
    ) -> anyhow::Result<PendingStep<B::InnerBackend>> {
        let reads = blocking_reads();
        let model = learner.model();
        let device = model.devices()[0].clone();
        B::seed(&device, step_seed(self.settings.seed, step));
        let mut micro: Vec<TokenBatch<B>> = batches.take(self.settings.grad_accum).collect();
        let tokens = self.settings.dp * micro.iter().map(TokenBatch::tokens).sum::<usize>();
        let loss_scale = self.scaler.as_ref().map_or(1.0, |s| lock(s).scale());
        for batch in &mut micro {
            batch.loss_scale = loss_scale / tokens as f64;
        }
        learner.lr_step();
        let split = &self.rank.split;
        let tensor_comm = split.tensor.comm_time();
        let heap = crate::alloc::registered().map(|heap| (heap, heap.start_window()));
        let zero = self.optimizer.update().zero();
        let passes = split.gradients(&model.chunks, &micro, zero.as_deref(), &device)?;
        drop((zero, model));
        let activation_peak_mib =
            heap.map(|(heap, before)| heap.window_peak().saturating_sub(before) as f64 / MIB);
        // The tensor-parallel collectives inside the forwards and backwards (and the
        // sequence-parallel gradient sums).
        let tensor_comm = split.tensor.comm_time().saturating_sub(tensor_comm);
        self.optimizer
            .set_loss_scale(self.scaler.as_ref().map(|_| loss_scale));
        learner.optimizer_step(passes.grads);
        let update = self.optimizer.take_stats()?;
        let loss_scale = self.scaler.as_ref().map(|scaler| {
            let mut scaler = lock(scaler);
            let skipped = scaler.update(update.skipped) == StepDecision::Skip;
            LossScaleRecord {
                scale: loss_scale,
                skipped,
                skipped_steps: scaler.skipped_steps(),
            }
        });
        let loss_sum = split.world_loss(&self.rank.world, passes.loss)?;
        let pipeline = PipelineReport::gather(&passes.stats, &split.pipe, &split.plan)?;
        let output = StepOutput {
            tokens,
            bubble: pipeline.as_ref().map(PipelineReport::worst_bubble),
            comm_ms: Some(
                1e3 * (update.reduce.comm + passes.unit_comm + tensor_comm).as_secs_f64(),
            ),
            loss_scale,
            activation_peak_mib,
            ..Default::default()
        };
        Ok(PendingStep {
            step,
            lr: learner.lr_current(),
            loss_sum,
            grad_norm: update.grad_norm,
            skipped: update.skipped,
            output,
            pipeline,
            host_reads: blocking_reads() - reads,
        })
    }

    /// Closes the log interval (one blocking read; see [`interval`]) and logs its steps: the
    /// metric files, burn-train's events, the losses for the caller. Returns whether the metric
    /// files took them. A gradient norm that is not finite without fp16's loss scale stops the
    /// run here, before any later checkpoint could save the damage.
    fn log_interval(
        &self,
        events: &mut SupervisedTrainingEventProcessor<GptComponents<B>>,
    ) -> anyhow::Result<bool> {
        let settings = &self.settings;
        let ranks = self.rank.world.size();
        let steps = lock(&self.interval).close(|tokens_per_sec| {
            let peak = settings.peak_flops?;
            Some(mfu(settings.flops_per_token, tokens_per_sec, ranks, peak))
        });
        let mut logged = true;
        for LoggedStep {
            step,
            lr,
            output,
            pipeline,
            host_reads,
        } in steps
        {
            let grad_norm = output.grad_norm.unwrap_or(f64::NAN);
            let tokens_per_sec = output.tokens_per_sec.unwrap_or(f64::NAN);
            let record = StepRecord {
                step,
                loss: output.step_loss.unwrap_or(f64::NAN),
                lr,
                grad_norm,
                tokens_per_sec,
                mfu: output.mfu,
                step_time_ms: 1e3 * output.tokens as f64 / tokens_per_sec,
                comm_ms: output.comm_ms.unwrap_or_default(),
                host_reads,
                loss_scale: output.loss_scale,
                activation_peak_mib: output.activation_peak_mib,
                pipeline,
            };
            lock(&self.losses).push(record.loss);
            logged &= self.to_sink(|sink| sink.log_step(&record));
            let item = item(output, step, settings.max_steps, Some(lr));
            events.process_train(LearnerEvent::ProcessedItem(item));
            if !grad_norm.is_finite() && self.scaler.is_none() {
                bail!(
                    "the gradient norm of step {step} is {grad_norm} (an infinite or NaN \
                     gradient on some rank); without fp16's loss scale there is nothing to \
                     lower, so training stops here (the checkpoints written so far are intact; \
                     a run that stops sooner logs more often: run.log_every)"
                );
            }
        }
        Ok(logged)
    }

    /// Mean validation loss per token over the evaluation batches (forward through the
    /// pipeline, or the sharded units under ZeRO 3). Every data-parallel replica evaluates the
    /// same batches.
    fn evaluate(
        &self,
        model: &GptChunks<B>,
        valid: &ValidLoader<GptComponents<B>>,
    ) -> anyhow::Result<StepOutput> {
        let batches: Vec<_> = valid.iter().collect();
        let tokens: usize = batches.iter().map(TokenBatch::tokens).sum();
        let zero = self.optimizer.update().zero();
        let loss_sum =
            (self.rank.split).forward_loss(&model.chunks, batches, zero.as_deref(), on_autodiff)?;
        let loss_sum = read_value(loss_sum);
        Ok(StepOutput {
            loss_sum,
            tokens,
            step_loss: Some(loss_sum / tokens.max(1) as f64),
            ..Default::default()
        })
    }

    /// Saves the checkpoint of `step`: in the background when the run asks for it, unless
    /// `last` (the run ends after it, so it is written before); either way after the write in
    /// flight.
    fn checkpoint(&self, model: &GptChunks<B>, step: u64, last: bool) -> anyhow::Result<()> {
        let cursor = lock(&self.sampler).cursor();
        let state = TrainState {
            step,
            cursor,
            schedule_step: step,
            loss_scaler: self.scaler.as_ref().map(|s| lock(s).clone()),
            ..self.state.clone()
        };
        let world = &self.rank.world;
        // The write in flight first: one snapshot in host memory at a time.
        let mut writer = lock(&self.writer);
        writer.wait(world)?;
        let snapshot = checkpoint::snapshot(
            model,
            self.optimizer.update(),
            state,
            world,
            self.rank.data.rank(),
            &self.rank.layout,
        )?;
        let (root, keep_last) = (&self.checkpoint_root, self.settings.keep_last);
        if self.settings.checkpoint_in_background && !last {
            return Ok(writer.start(root, snapshot, world, keep_last)?);
        }
        snapshot.write(root, world)?;
        if world.rank() == 0 {
            checkpoint::prune(root, keep_last);
        }
        Ok(())
    }

    fn record_error(&self, error: anyhow::Error) {
        self.error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(error);
    }

    fn log(&self, record: Result<(), anyhow::Error>) -> bool {
        match record {
            Ok(()) => true,
            Err(error) => {
                self.record_error(error);
                false
            }
        }
    }

    /// Runs `write` on the metric files (rank 0; nothing elsewhere).
    fn to_sink(&self, write: impl FnOnce(&mut MetricsSink) -> anyhow::Result<()>) -> bool {
        match &self.sink {
            Some(sink) => self.log(write(&mut lock(sink))),
            None => true,
        }
    }
}

fn item(
    output: StepOutput,
    step: u64,
    max_steps: u64,
    lr: Option<f64>,
) -> TrainingItem<StepOutput> {
    TrainingItem::new(
        output,
        Progress::new(step as usize, max_steps as usize),
        Progress::new(1, 1),
        Some(step as usize),
        lr,
    )
}

impl<B: TrainBackend> SupervisedLearningStrategy<GptComponents<B>> for StepLoop<B> {
    fn fit(
        &self,
        components: TrainingComponents<GptComponents<B>>,
        mut learner: Learner<GptComponents<B>>,
        train: BurnTrainLoader<GptComponents<B>>,
        valid: ValidLoader<GptComponents<B>>,
        _starting_epoch: usize,
    ) -> (
        GptChunks<B>,
        SupervisedTrainingEventProcessor<GptComponents<B>>,
    ) {
        let mut events = components.event_processor;
        let mut batches = train.iter();
        // The first interval's time starts with its first step.
        lock(&self.interval).restart();
        for step in self.settings.start_step..self.settings.max_steps {
            let stopped = self
                .train_and_log(&mut learner, &mut *batches, &mut events, step)
                .and_then(|logged| self.stop_vote(components.interrupter.should_stop() || !logged))
                .and_then(|stop| {
                    self.evaluate_and_checkpoint(&learner, &valid, &mut events, step + 1, stop)?;
                    Ok(stop)
                });
            match stopped {
                Ok(false) => {}
                Ok(true) => break,
                Err(error) => {
                    self.record_error(error);
                    break;
                }
            }
        }
        if let Some(error) = lock(&self.writer).wait_alone() {
            self.record_error(error.into());
        }
        // Steps trained before an error are logged all the same.
        if let Err(error) = self.log_interval(&mut events) {
            self.record_error(error);
        }
        (learner.model(), events)
    }
}

impl<B: TrainBackend> StepLoop<B> {
    /// Trains step `step`, and logs the interval it ends (metric files, burn-train's events)
    /// every `log_every` steps; returns whether the metric files took what was logged.
    fn train_and_log(
        &self,
        learner: &mut Learner<GptComponents<B>>,
        batches: &mut dyn Iterator<Item = TokenBatch<B>>,
        events: &mut SupervisedTrainingEventProcessor<GptComponents<B>>,
        step: u64,
    ) -> anyhow::Result<bool> {
        let started = Instant::now();
        let pending = (self.step(learner, batches, step))
            .map_err(|error| error.context(format!("step {step}")))?;
        let reads = pending.host_reads;
        lock(&self.interval).push(pending);
        self.profile_step(learner, step, started, reads)
            .map_err(|error| error.context(format!("profiling step {step}")))?;
        match (step + 1).is_multiple_of(self.settings.log_every.max(1)) {
            true => self.log_interval(events),
            false => Ok(true),
        }
    }

    /// Under `run.profile`, on rank 0: syncs the device after the first step (whose table,
    /// which holds compilation and tuning, is dropped) and after each of the next
    /// `run.profile` steps, and prints each of those steps' table of kernels (see
    /// `wildfire_backend::profile`) with its wall time, the time outside its kernels and its
    /// blocking reads (`reads`). With ranks as threads the table holds every rank's kernels.
    fn profile_step(
        &self,
        learner: &Learner<GptComponents<B>>,
        step: u64,
        started: Instant,
        reads: u64,
    ) -> anyhow::Result<()> {
        let settings = &self.settings;
        let Some(file) = &settings.profile_file else {
            return Ok(());
        };
        let first = settings.start_step;
        if self.rank.world.rank() != 0 || step > first + settings.profile_steps {
            return Ok(());
        }
        // The model (a handle per parameter) is fetched only on the steps that profile.
        let device = learner.model().devices()[0].clone();
        B::sync(&device).map_err(|e| anyhow::anyhow!("syncing the device: {e:?}"))?;
        let wall = started.elapsed();
        let mut offset = lock(&self.profile_offset);
        let (table, next) = next_table(file, *offset, PROFILE_WAIT).map_err(anyhow::Error::msg)?;
        *offset = next;
        if step > first {
            let ms = |d: Duration| 1e3 * d.as_secs_f64();
            println!(
                "profile of step {step}: {:.2} ms wall, {:.2} ms in kernels, {:.2} ms outside \
                 them; {reads} blocking reads\n{}",
                ms(wall),
                ms(table.total),
                ms(wall.saturating_sub(table.total)),
                table
            );
        }
        Ok(())
    }

    /// Whether every rank stops now: a stop request or a failed metrics write on any rank stops
    /// all of them (after the step's checkpoint).
    fn stop_vote(&self, stop_here: bool) -> anyhow::Result<bool> {
        let votes = self.rank.world.sum_value(f64::from(u8::from(stop_here)))?;
        Ok(votes > 0.0)
    }

    /// After `done` steps: the validation loss every `eval_every` steps and at the end, and a
    /// checkpoint every `checkpoint.every` steps, at the end, and when the run stops.
    fn evaluate_and_checkpoint(
        &self,
        learner: &Learner<GptComponents<B>>,
        valid: &ValidLoader<GptComponents<B>>,
        events: &mut SupervisedTrainingEventProcessor<GptComponents<B>>,
        done: u64,
        stop: bool,
    ) -> anyhow::Result<()> {
        let settings = &self.settings;
        let last = done == settings.max_steps;
        let evaluates =
            settings.eval_every > 0 && (done.is_multiple_of(settings.eval_every) || last);
        let periodic =
            settings.checkpoint_every > 0 && done.is_multiple_of(settings.checkpoint_every);
        let checkpoints = periodic || last || stop;
        if !(evaluates || checkpoints) {
            return Ok(());
        }
        // What is evaluated or saved was trained by steps that are all logged (and checked).
        self.log_interval(events)?;
        if evaluates {
            let eval = (self.evaluate(&learner.model(), valid))
                .map_err(|error| error.context(format!("evaluation after step {}", done - 1)))?;
            let val_loss = eval.step_loss.unwrap_or(f64::NAN);
            self.to_sink(|sink| sink.log_eval(done, val_loss));
            let item = item(eval, done, settings.max_steps, None);
            events.process_valid(LearnerEvent::ProcessedItem(item));
        }
        if checkpoints {
            self.checkpoint(&learner.model(), done, last || stop)?;
        }
        lock(&self.interval).restart();
        Ok(())
    }
}

/// An evaluation batch (inner backend) on the autodiff backend, untracked.
fn on_autodiff<B: TrainBackend>(batch: TokenBatch<B::InnerBackend>) -> TokenBatch<B> {
    TokenBatch {
        inputs: Tensor::from_inner(batch.inputs),
        targets: Tensor::from_inner(batch.targets),
        loss_scale: batch.loss_scale,
    }
}

#[cfg(test)]
mod tests {
    use super::mfu;

    /// Four ranks at one rank's throughput each: four times the job's tokens/s, the same MFU.
    #[test]
    fn mfu_does_not_grow_with_the_world() {
        let one = mfu(6e8, 1e3, 1, 1e13);
        assert_eq!(one, 0.06);
        assert_eq!(mfu(6e8, 4e3, 4, 1e13), one);
    }
}
