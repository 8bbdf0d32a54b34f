//! Data parallelism for a Burn user's own model on burn-train: the Learner's model and
//! optimizer are what trains; the user's `TrainStep`, `ValidStep` (`InferenceStep`), loaders and
//! metrics stay theirs. They change the backend to `Autodiff<Parallel<B>>`, build the
//! optimizer through [`DataParallel`] and add one strategy line:
//!
//! ```text
//! let strategy = DataParallel::from_env(ParallelDims::data(dp, ZeroStage::One))?;
//! let optimizer = strategy.adamw(&model, FusedAdamW::new(0.9, 0.999, 1e-8, 0.01));
//! SupervisedTraining::new(strategy.artifact_dir(dir), train, valid)
//!     .with_training_strategy(strategy.into()) /* metrics, epochs … */
//!     .launch(Learner::new(model, optimizer, lr));
//! ```
//!
//! What happens on each of the `p` data-parallel ranks:
//! - **Start.** The model's parameters are broadcast from rank 0 (so ranks that drew them
//!   differently, or lazily, train one model) and checked bitwise alike.
//! - **Data.** Rank `r` trains on items `[r·n/p, (r+1)·n/p)` of the train loader (`n/p` rounded
//!   down on every rank, so every rank takes as many steps; the remainder is left out). Step
//!   `k`'s global batch is the concatenation of every rank's `k`-th batch.
//! - **Gradients.** [`ParallelOptimizer`] reduces them over the ranks (DDP's buckets, or ZeRO
//!   1/2's all-reduce / reduce-scatter), clips by the global norm, and steps: with the user's
//!   own Burn optimizer under DDP, with the sharded AdamW under ZeRO. A `TrainStep` returns the
//!   gradient of its batch's *mean* loss, as Burn's do, so the sum over ranks is divided by
//!   `p`: the step is the one of the mean loss over the global batch, as PyTorch's DDP does.
//! - **Validation** runs on rank 0 over the whole validation set (every replica holds the same
//!   model, so its loss is the mean over all ranks' data); the other ranks wait for it.
//! - **Files and progress.** Rank 0 alone renders progress and records metrics. burn-train's
//!   checkpointer runs on every rank, each in its own directory ([`DataParallel::artifact_dir`]):
//!   under ZeRO a rank's optimizer record is its own shard of the moments.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::data::dataloader::Progress;
use burn::module::{AutodiffModule, Module};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{GradientsAccumulator, GradientsParams, MultiGradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn::train::LearnerSummary;
use burn::train::metric::MetricDefinition;
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn::train::{
    EventProcessorTraining, InferenceStep, Learner, LearnerEvent, LearningComponentsTypes,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainingComponents,
    TrainingItem, TrainingModel, TrainingStrategy, ValidLoader,
};
use wildfire_backend::comm::ProcessGroup;
use wildfire_backend::kernels::adamw::FusedAdamW;

use crate::dp::{self, DEFAULT_BUCKET_BYTES, FlatLayout};
use crate::fsdp::{FullMoments, ShardMoments, ZeroOptimizer, ZeroStage};
use crate::mesh::{Mesh, MeshError, ParallelDims};
use crate::pp::graphs_lock;
use crate::replicas::{broadcast_parameters, verify_replicas};
use crate::update::{StepOptions, Update, UpdateGroups, inner_device, lock};

/// The burn-train strategy of data parallelism (DDP or ZeRO 1/2): see the module doc.
#[derive(Debug, Clone)]
pub struct DataParallel {
    mesh: Mesh,
    bucket_bytes: usize,
    max_norm: f64,
    offload: bool,
}

impl DataParallel {
    /// Data parallelism over `mesh`'s data-parallel group, as `mesh.dims().zero` says.
    pub fn new(mesh: Mesh) -> Self {
        Self {
            mesh,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            max_norm: 0.0,
            offload: false,
        }
    }

    /// The strategy of a launched job (`wildfire launch`): `dims` checked against its world.
    pub fn from_env(dims: ParallelDims) -> Result<Self, MeshError> {
        Ok(Self::new(Mesh::from_env(dims)?))
    }

    /// Gradient buckets of at most `bytes` (default 25 MiB).
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes;
        self
    }

    /// Clips the global gradient norm to `max_norm` (0, the default, only measures it).
    pub fn with_grad_clip(mut self, max_norm: f64) -> Self {
        self.max_norm = max_norm;
        self
    }

    /// Keeps ZeRO's sharded optimizer state in host memory and updates it there.
    pub fn with_offload(mut self, offload: bool) -> Self {
        self.offload = offload;
        self
    }

    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// Where this rank's burn-train artifacts go: `dir` itself on rank 0 (metrics, progress
    /// logs, its checkpoints), `dir/rank-r` on rank `r` (its checkpoints: under ZeRO its shard
    /// of the optimizer state).
    pub fn artifact_dir(&self, dir: impl AsRef<Path>) -> PathBuf {
        match self.mesh.world().rank() {
            0 => dir.as_ref().to_path_buf(),
            rank => dir.as_ref().join(format!("rank-{rank}")),
        }
    }

    /// AdamW for `model` as this strategy's ZeRO stage runs it: Burn's optimizer adaptor over
    /// `adamw` (bit for bit Burn's AdamW) after DDP's all-reduce under stage 0, the sharded
    /// flat AdamW under stages 1 and 2. Stage 3 needs the model cut into units and is not
    /// offered here.
    pub fn adamw<A, M>(
        &self,
        model: &M,
        adamw: FusedAdamW,
    ) -> ParallelOptimizer<A, OptimizerAdaptor<FusedAdamW, M, A>>
    where
        A: AutodiffBackend,
        M: AutodiffModule<A>,
    {
        let stage = self.mesh.dims().zero;
        assert!(
            stage != ZeroStage::Three,
            "DataParallel trains ZeRO stages 0–2 on burn-train; {stage} needs the model cut into \
             units (see docs/architecture.md)"
        );
        let layout = FlatLayout::of_module(model, self.bucket_bytes);
        let update = match stage {
            ZeroStage::Zero0 => Update::replicated(OptimizerAdaptor::from(adamw), layout),
            _ => {
                let mut zero = ZeroOptimizer::new(
                    stage,
                    self.mesh.data().clone(),
                    layout,
                    (adamw.clone(), adamw),
                    self.offload,
                    inner_device(model),
                );
                zero.set_params(&dp::flat_params(model));
                Update::sharded(zero)
            }
        };
        self.optimizer(update)
    }

    /// Any Burn optimizer for `model`, stepped after DDP's all-reduce (ZeRO stage 0 only: the
    /// sharded stages own their AdamW, see [`Self::adamw`]).
    pub fn replicated<A, M, O>(&self, model: &M, optimizer: O) -> ParallelOptimizer<A, O>
    where
        A: AutodiffBackend,
        M: AutodiffModule<A>,
        O: Optimizer<M, A>,
    {
        let layout = FlatLayout::of_module(model, self.bucket_bytes);
        self.optimizer(Update::replicated(optimizer, layout))
    }

    fn optimizer<A: AutodiffBackend, O>(&self, update: Update<A, O>) -> ParallelOptimizer<A, O> {
        ParallelOptimizer {
            update: Arc::new(update),
            mesh: self.mesh.clone(),
            max_norm: self.max_norm,
        }
    }
}

/// A Burn optimizer that reduces the gradients it is given over the data-parallel ranks before
/// it steps (see the module doc): the Learner's optimizer under [`DataParallel`]. Clones share
/// one state. Its record is the inner optimizer's under DDP, this rank's shard of the moments
/// under ZeRO.
///
/// Burn's `Optimizer::step` cannot fail: a failed collective panics with its error.
pub struct ParallelOptimizer<A: AutodiffBackend, O> {
    update: Arc<Update<A, O>>,
    mesh: Mesh,
    max_norm: f64,
}

impl<A: AutodiffBackend, O> Clone for ParallelOptimizer<A, O> {
    fn clone(&self) -> Self {
        Self {
            update: self.update.clone(),
            mesh: self.mesh.clone(),
            max_norm: self.max_norm,
        }
    }
}

impl<A: AutodiffBackend, O> std::fmt::Debug for ParallelOptimizer<A, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParallelOptimizer")
            .field("update", &self.update)
            .field("max_norm", &self.max_norm)
            .finish_non_exhaustive()
    }
}

/// Marks the optimizers whose step synchronises gradients over the data-parallel ranks: the
/// only ones [`DataParallel`] trains with (a plain Burn optimizer would let the replicas drift
/// apart silently).
pub trait SynchronizesGradients {}

impl<A: AutodiffBackend, O> SynchronizesGradients for ParallelOptimizer<A, O> {}

impl<A: AutodiffBackend, O> ParallelOptimizer<A, O> {
    /// Follows a model whose record was loaded (it took the record's parameter ids), and
    /// takes its parameters as the sharded optimizer's master copy where it keeps one.
    fn follow<M: AutodiffModule<A>>(&self, module: &M) {
        let specs = dp::param_specs(module);
        let rebound = match &*self.update {
            Update::Replicated { layout, .. } => {
                let mut layout = lock(layout);
                match layout.matches(&specs) {
                    true => Ok(()),
                    false => layout.rebind(&specs),
                }
            }
            Update::Sharded(zero) => {
                let mut zero = lock(zero);
                match zero.layout().matches(&specs) {
                    true => Ok(()),
                    false => zero.rebind(&specs).map_err(|e| e.to_string()).map(|()| {
                        zero.set_params(&dp::flat_params(module));
                    }),
                }
            }
        };
        if let Err(error) = rebound {
            panic!("data parallelism: the model no longer matches its optimizer: {error}");
        }
    }
}

/// One bucket's shard of the AdamW moments in a checkpoint.
#[derive(burn::record::Record, Debug)]
pub struct ShardRecord<B: burn::tensor::backend::Backend> {
    pub start: usize,
    pub end: usize,
    pub bucket_numel: usize,
    pub time: usize,
    pub exp_avg: Option<Tensor<B, 1>>,
    pub exp_avg_sq: Option<Tensor<B, 1>>,
}

impl<A, M, O> Optimizer<M, A> for ParallelOptimizer<A, O>
where
    A: AutodiffBackend,
    M: AutodiffModule<A>,
    O: Optimizer<M, A> + Clone,
{
    /// The inner optimizer's record (DDP) and this rank's moment shards (ZeRO).
    type Record = (Option<O::Record>, Vec<ShardRecord<A>>);

    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        self.follow(&module);
        let ranks = self.mesh.data().size() as f64;
        let options = StepOptions {
            // The gradients are those of the sum of `ranks` batch means: unscale by `ranks`.
            loss_scale: ranks,
            ..StepOptions::new(lr, self.max_norm)
        };
        let groups = UpdateGroups::from(&self.mesh);
        match self.update.update(groups, module, grads, options) {
            Ok((module, _stats)) => module,
            Err(error) => panic!("data-parallel optimizer step: {error}"),
        }
    }

    fn to_record(&self) -> Self::Record {
        match &*self.update {
            Update::Replicated { optimizer, .. } => (Some(lock(optimizer).to_record()), vec![]),
            Update::Sharded(zero) => {
                let shards = lock(zero)
                    .shard_moments()
                    .into_iter()
                    .map(|shard| {
                        let (time, m1, m2) = match shard.moments {
                            Some(m) => (
                                m.time,
                                Some(Tensor::from_inner(m.exp_avg)),
                                Some(Tensor::from_inner(m.exp_avg_sq)),
                            ),
                            None => (0, None, None),
                        };
                        ShardRecord {
                            start: shard.range.start,
                            end: shard.range.end,
                            bucket_numel: shard.bucket_numel,
                            time,
                            exp_avg: m1,
                            exp_avg_sq: m2,
                        }
                    })
                    .collect();
                (None, shards)
            }
        }
    }

    fn load_record(self, (replicated, shards): Self::Record) -> Self {
        let stage = self.update.stage();
        match (&*self.update, replicated) {
            (Update::Replicated { optimizer, .. }, Some(record)) => {
                let mut optimizer = lock(optimizer);
                *optimizer = optimizer.clone().load_record(record);
            }
            (Update::Sharded(zero), None) => {
                let saved = shards
                    .into_iter()
                    .map(|s| ShardMoments {
                        range: s.start..s.end,
                        bucket_numel: s.bucket_numel,
                        moments: match (s.exp_avg, s.exp_avg_sq) {
                            (Some(m1), Some(m2)) => Some(FullMoments {
                                exp_avg: m1.inner(),
                                exp_avg_sq: m2.inner(),
                                time: s.time,
                            }),
                            _ => None,
                        },
                    })
                    .collect();
                if let Err(error) = lock(zero).set_shard_moments(saved) {
                    panic!("loading the data-parallel optimizer: {error}");
                }
            }
            (_, replicated) => panic!(
                "loading the data-parallel optimizer: the checkpoint was saved {}, but this run \
                 is {stage}: resume under the ZeRO stage that saved it (stages 1 and 2 share \
                 their records)",
                match replicated {
                    Some(_) => "under DDP (ZeRO-0)",
                    None => "under a sharded stage (ZeRO 1 or 2)",
                }
            ),
        }
        self
    }

    fn step_multi(&mut self, lr: f64, module: M, grads: MultiGradientsParams) -> M {
        let mut parts = grads.grads;
        match (parts.pop(), parts.is_empty()) {
            (Some((grads, _)), true) => self.step(lr, module, grads),
            _ => panic!(
                "data parallelism takes one device's gradients per rank, not {}",
                parts.len() + 1
            ),
        }
    }
}

impl<LC: LearningComponentsTypes> From<DataParallel> for TrainingStrategy<LC>
where
    LC::Optimizer: SynchronizesGradients,
{
    fn from(strategy: DataParallel) -> Self {
        TrainingStrategy::Custom(Arc::new(strategy))
    }
}

/// A burn-train renderer that shows nothing: for every rank but rank 0, whose progress is
/// the job's (`if rank != 0 { training = training.renderer(Silent) }`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Silent;

impl MetricsRendererTraining for Silent {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
    fn render_train(&mut self, _item: TrainingProgress, _indicators: Vec<ProgressType>) {}
    fn render_valid(&mut self, _item: TrainingProgress, _indicators: Vec<ProgressType>) {}
    fn on_train_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for Silent {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn render_test(&mut self, _item: EvaluationProgress, _indicators: Vec<ProgressType>) {}
}

impl MetricsRenderer for Silent {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}

impl<LC: LearningComponentsTypes> SupervisedLearningStrategy<LC> for DataParallel
where
    LC::Optimizer: SynchronizesGradients,
{
    fn fit(
        &self,
        components: TrainingComponents<LC>,
        mut learner: Learner<LC>,
        train: TrainLoader<LC>,
        valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        let data = self.mesh.data();
        let leader = self.mesh.world().rank() == 0;
        identical_replicas(&mut learner, data);
        let train = shard_loader(train, data);
        let mut processor = components.event_processor;
        let mut checkpointer = components.checkpointer;
        let interrupter = components.interrupter;
        for epoch in starting_epoch..=components.num_epochs {
            let progress = Progress::new(epoch, components.num_epochs);
            train_epoch(
                &mut learner,
                &train,
                components.grad_accumulation,
                &progress,
                leader.then_some(&mut processor),
            );
            if leader {
                valid_epoch(&learner, &valid, &progress, &mut processor);
            }
            barrier(self.mesh.world(), "after validation");
            if let Some(checkpointer) = &mut checkpointer {
                checkpointer.checkpoint(&learner, epoch, &components.event_store);
            }
            if interrupter.should_stop() {
                break;
            }
        }
        (learner.model(), processor)
    }
}

/// Waits for every rank of `group`; a failure panics (burn-train's `fit` cannot return one).
fn barrier(group: &ProcessGroup, when: &str) {
    if let Err(error) = group.barrier() {
        panic!("data parallelism, {when}: {error}");
    }
}

/// Makes every data-parallel replica of the learner's model rank 0's, and checks them bitwise.
fn identical_replicas<LC: LearningComponentsTypes>(learner: &mut Learner<LC>, data: &ProcessGroup) {
    let synced = broadcast_parameters(learner.model(), data)
        .and_then(|model| verify_replicas(&model, data).map(|()| model));
    match synced {
        Ok(model) => {
            let _lock = graphs_lock();
            learner.load_model(model.into_record());
        }
        Err(error) => panic!("data parallelism at start: {error}"),
    }
}

/// This rank's part of `loader`: an equal share of its items on every rank.
fn shard_loader<B: burn::tensor::backend::Backend, I>(
    loader: Arc<dyn burn::data::dataloader::DataLoader<B, I>>,
    data: &ProcessGroup,
) -> Arc<dyn burn::data::dataloader::DataLoader<B, I>> {
    let (rank, ranks) = (data.rank(), data.size());
    if ranks == 1 {
        return loader;
    }
    let share = loader.num_items() / ranks;
    loader.slice(rank * share, (rank + 1) * share)
}

/// One epoch of training on this rank's share; `processor` on rank 0 only.
fn train_epoch<LC: LearningComponentsTypes>(
    learner: &mut Learner<LC>,
    loader: &TrainLoader<LC>,
    accumulation: Option<usize>,
    epoch: &Progress,
    mut processor: Option<&mut SupervisedTrainingEventProcessor<LC>>,
) {
    let mut items = loader.iter();
    let mut accumulator = GradientsAccumulator::new();
    let mut accumulated = 0;
    let mut iteration = 0;
    while let Some(item) = items.next() {
        iteration += 1;
        learner.lr_step();
        let output = {
            // Thread ranks share Burn's autodiff registry (see `crate::pp::graphs_lock`).
            let _lock = graphs_lock();
            learner.train_step(item)
        };
        match accumulation {
            Some(every) => {
                accumulator.accumulate(&learner.model(), output.grads);
                accumulated += 1;
                if accumulated >= every {
                    learner.optimizer_step(accumulator.grads());
                    accumulated = 0;
                }
            }
            None => learner.optimizer_step(output.grads),
        }
        if let Some(processor) = processor.as_deref_mut() {
            let item = TrainingItem::new(
                output.item,
                items.progress(),
                epoch.clone(),
                Some(iteration),
                Some(learner.lr_current()),
            );
            processor.process_train(LearnerEvent::ProcessedItem(item));
        }
    }
    if let Some(processor) = processor {
        processor.process_train(LearnerEvent::EndEpoch(epoch.items_processed));
    }
}

/// Validation over the whole validation set.
fn valid_epoch<LC: LearningComponentsTypes>(
    learner: &Learner<LC>,
    loader: &ValidLoader<LC>,
    epoch: &Progress,
    processor: &mut SupervisedTrainingEventProcessor<LC>,
) {
    let model = learner.model().valid();
    let mut items = loader.iter();
    let mut iteration = 0;
    while let Some(item) = items.next() {
        iteration += 1;
        let output = model.step(item);
        let item = TrainingItem::new(
            output,
            items.progress(),
            epoch.clone(),
            Some(iteration),
            None,
        );
        processor.process_valid(LearnerEvent::ProcessedItem(item));
    }
    processor.process_valid(LearnerEvent::EndEpoch(epoch.items_processed));
}
