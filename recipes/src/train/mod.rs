//! The training loop: step-based, on burn-train. `run` prepares data, model, optimizer and the
//! run directory; [`StepLoop`] is the burn-train learning strategy that runs the steps:
//!
//! ```text
//! for s in start..max_steps:
//!     reseed the backend RNG from (seed, s)                     # dropout, resumable
//!     draw the step's global batch; cut it into grad_accum micro-batches
//!     for each micro-batch: backward of (Σ token losses) / (tokens in the whole step)
//!     sum the micro-batch gradients; clip by the global norm
//!     AdamW step at lr(s); log loss, lr, grad norm, tokens/s, MFU
//!     every eval_every steps: validation loss; every checkpoint.every steps: checkpoint
//! ```

mod batch;
mod setup;

pub use batch::{EvalLoader, TokenBatch, TrainLoader};
pub use setup::{TrainOutcome, resume_config, run};

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::data::dataloader::Progress;
use burn::module::Module;
use burn::optim::GradientsAccumulator;
use burn::tensor::backend::AutodiffBackend;
use burn::train::EventProcessorTraining;
use burn::train::{
    InferenceStep, Learner, LearnerEvent, LearningComponentsMarker, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader as BurnTrainLoader, TrainingComponents,
    TrainingItem, ValidLoader,
};

use crate::checkpoint::{self, TrainState};
use crate::data::{Sampler, SplitMix64};
use crate::logging::{MetricsSink, StepOutput, StepRecord};
use crate::model::Gpt;
use crate::optim::{GptOptimizer, WarmupCosine, clip_global_norm};

/// burn-train's components for the GPT recipe on backend `B`.
pub type GptComponents<B> =
    LearningComponentsMarker<B, WarmupCosine, Gpt<B>, GptOptimizer<Gpt<B>, B>>;

/// The fixed settings of a run's loop.
#[derive(Debug, Clone)]
pub struct LoopSettings {
    pub start_step: u64,
    pub max_steps: u64,
    pub grad_accum: usize,
    pub grad_clip: f64,
    pub eval_every: u64,
    pub checkpoint_every: u64,
    pub keep_last: usize,
    pub seed: u64,
    /// Training FLOPs per token (see `GptConfig::flops_per_token`).
    pub flops_per_token: f64,
    pub peak_flops: Option<f64>,
}

/// The step-based learning strategy. Besides what burn-train hands to `fit`, it holds the shared
/// handles it checkpoints (optimizer, sampler) and the metric files.
pub struct StepLoop<B: AutodiffBackend> {
    pub settings: LoopSettings,
    pub optimizer: GptOptimizer<Gpt<B>, B>,
    pub sampler: Arc<Mutex<Sampler>>,
    pub sink: Mutex<MetricsSink>,
    /// Checkpoint template: everything but the step-dependent fields.
    pub state: TrainState,
    pub checkpoint_root: PathBuf,
    /// The first error of the loop (a checkpoint or a metrics write that failed); the loop
    /// stops at it and `run` returns it.
    pub error: Mutex<Option<anyhow::Error>>,
    /// Per-step mean losses, for the caller.
    pub losses: Mutex<Vec<f64>>,
}

/// The backend seed of step `s`: dropout masks depend only on `(seed, s)`.
pub fn step_seed(seed: u64, step: u64) -> u64 {
    SplitMix64::new(seed ^ step.wrapping_mul(0xD1B5_4A32_D192_ED03)).next_u64()
}

impl<B: AutodiffBackend> std::fmt::Debug for StepLoop<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepLoop")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl<B: AutodiffBackend> StepLoop<B> {
    /// One optimizer step (all its micro-batches); returns the numbers it logs.
    fn step(
        &self,
        learner: &mut Learner<GptComponents<B>>,
        batches: &mut dyn Iterator<Item = TokenBatch<B>>,
        step: u64,
    ) -> StepOutput {
        let started = Instant::now();
        let device = learner.model().devices()[0].clone();
        B::seed(&device, step_seed(self.settings.seed, step));
        let mut micro: Vec<TokenBatch<B>> = batches.take(self.settings.grad_accum).collect();
        let tokens: usize = micro.iter().map(TokenBatch::tokens).sum();
        learner.lr_step();
        let mut accumulator = GradientsAccumulator::new();
        let mut loss_sum = 0.0;
        for mut batch in micro.drain(..) {
            batch.loss_scale = 1.0 / tokens as f64;
            let output = learner.train_step(batch);
            loss_sum += output.item.loss_sum;
            accumulator.accumulate(&learner.model(), output.grads);
        }
        let mut grads = accumulator.grads();
        let grad_norm = clip_global_norm(&learner.model(), &mut grads, self.settings.grad_clip);
        learner.optimizer_step(grads);
        let seconds = started.elapsed().as_secs_f64();
        let tokens_per_sec = tokens as f64 / seconds;
        StepOutput {
            loss_sum,
            tokens,
            step_loss: Some(loss_sum / tokens as f64),
            grad_norm: Some(grad_norm),
            tokens_per_sec: Some(tokens_per_sec),
            mfu: self
                .settings
                .peak_flops
                .map(|peak| self.settings.flops_per_token * tokens_per_sec / peak),
        }
    }

    /// Mean validation loss per token over the evaluation batches.
    fn evaluate(&self, model: &Gpt<B>, valid: &ValidLoader<GptComponents<B>>) -> StepOutput {
        let model = burn::module::AutodiffModule::valid(model);
        let (mut loss_sum, mut tokens) = (0.0, 0);
        for batch in valid.iter() {
            let output = InferenceStep::step(&model, batch);
            loss_sum += output.loss_sum;
            tokens += output.tokens;
        }
        StepOutput {
            loss_sum,
            tokens,
            step_loss: Some(loss_sum / tokens.max(1) as f64),
            ..Default::default()
        }
    }

    fn checkpoint(&self, learner: &Learner<GptComponents<B>>, step: u64) -> anyhow::Result<()> {
        let cursor = self
            .sampler
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .cursor();
        let state = TrainState {
            step,
            cursor,
            schedule_step: step,
            ..self.state.clone()
        };
        checkpoint::save(
            &self.checkpoint_root,
            &learner.model(),
            &self.optimizer,
            state,
        )?;
        if self.settings.keep_last > 0 {
            checkpoint::store::prune(&self.checkpoint_root, self.settings.keep_last)?;
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

    fn sink(&self) -> std::sync::MutexGuard<'_, MetricsSink> {
        self.sink.lock().unwrap_or_else(|p| p.into_inner())
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

impl<B: AutodiffBackend> SupervisedLearningStrategy<GptComponents<B>> for StepLoop<B> {
    fn fit(
        &self,
        components: TrainingComponents<GptComponents<B>>,
        mut learner: Learner<GptComponents<B>>,
        train: BurnTrainLoader<GptComponents<B>>,
        valid: ValidLoader<GptComponents<B>>,
        _starting_epoch: usize,
    ) -> (Gpt<B>, SupervisedTrainingEventProcessor<GptComponents<B>>) {
        let mut events = components.event_processor;
        let settings = &self.settings;
        let mut batches = train.iter();
        for step in settings.start_step..settings.max_steps {
            let output = self.step(&mut learner, &mut *batches, step);
            let lr = learner.lr_current();
            let record = StepRecord {
                step,
                loss: output.step_loss.unwrap_or(f64::NAN),
                lr,
                grad_norm: output.grad_norm.unwrap_or(f64::NAN),
                tokens_per_sec: output.tokens_per_sec.unwrap_or(f64::NAN),
                mfu: output.mfu,
                step_time_ms: 1e3 * output.tokens as f64
                    / output.tokens_per_sec.unwrap_or(f64::NAN),
            };
            self.losses
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(record.loss);
            let logged = self.log(self.sink().log_step(&record));
            events.process_train(LearnerEvent::ProcessedItem(item(
                output,
                step,
                settings.max_steps,
                Some(lr),
            )));
            let done = step + 1;
            let last = done == settings.max_steps;
            let stop = components.interrupter.should_stop() || !logged;
            if settings.eval_every > 0 && (done % settings.eval_every == 0 || last) {
                let eval = self.evaluate(&learner.model(), &valid);
                let val_loss = eval.step_loss.unwrap_or(f64::NAN);
                self.log(self.sink().log_eval(done, val_loss));
                events.process_valid(LearnerEvent::ProcessedItem(item(
                    eval,
                    done,
                    settings.max_steps,
                    None,
                )));
            }
            let periodic = settings.checkpoint_every > 0 && done % settings.checkpoint_every == 0;
            if (periodic || last || stop) && !self.log(self.checkpoint(&learner, done)) {
                break;
            }
            if stop {
                break;
            }
        }
        (learner.model(), events)
    }
}
