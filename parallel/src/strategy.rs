//! Data parallelism for a Burn user's own model on burn-train: the Learner's model and
//! optimizer are what trains; the user's `TrainStep`, `ValidStep` (`InferenceStep`), loaders and
//! metrics stay theirs. They change the backend to `Autodiff<Parallel<B>>`, build the
//! optimizer through [`DataParallel`] and add one strategy line:
//!
//! ```text
//! let strategy = DataParallel::from_env(ParallelDims::data(dp, ZeroStage::ShardOptimizer))?;
//! let optimizer = strategy.adamw(&model, FusedAdamW::new(0.9, 0.999, 1e-8, 0.01))?;
//! SupervisedTraining::new(strategy.artifact_dir(dir), train, valid)
//!     .metric_train_numeric(strategy.grad_norm_metric()) /* optional */
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
//!   own Burn optimizer under DDP and ZeRO 3, with the sharded AdamW under ZeRO 1/2. A
//!   `TrainStep` returns the gradient of its batch's *mean* loss, as Burn's do, so the sum over
//!   ranks is divided by `p`: the step is the one of the mean loss over the global batch, as
//!   PyTorch's DDP does.
//! - **ZeRO 3** shards the parts of the model wrapped in [`crate::fsdp::ShardedUnit`]: after
//!   the start's broadcast each rank keeps its rows of their parameters, and every forward and
//!   backward of the Learner runs in a gather scope ([`crate::fsdp::gather_units_within`]). It
//!   needs `Autodiff<Parallel<B>, BalancedCheckpointing>`. Ranks that are threads of one
//!   process run their forward and backward passes one at a time (the autodiff lock), so no
//!   collective can run inside them: there the Learner's model keeps its units whole, and
//!   each optimizer step cuts them to the rank's rows, reduce-scatters their gradients, steps
//!   the rows and gathers them again (the same arithmetic, without the memory saving).
//! - **Validation** runs on rank 0 over the whole validation set (every replica holds the same
//!   model, so its loss is the mean over all ranks' data); the other ranks wait for it. Under
//!   ZeRO 3 every rank runs it alongside (the units gather collectively), rank 0 records it.
//! - **Files and progress.** Rank 0 alone renders progress and records metrics
//!   ([`DataParallel::grad_norm_metric`] adds the global gradient norm). burn-train's
//!   checkpointer runs on every rank, each in its own directory ([`DataParallel::artifact_dir`]).
//!   The model is saved whole under every stage (ZeRO 3 gathers it for the save, and for the
//!   model `fit` returns); the optimizer record of [`DataParallel::adamw`] holds this rank's
//!   pieces of the moments by parameter position, so it resumes under any stage
//!   ([`crate::moments`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::data::dataloader::Progress;
use burn::module::{AutodiffModule, Module};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{GradientsAccumulator, GradientsParams, MultiGradientsParams, Optimizer};
use burn::tensor::Device;
use burn::tensor::backend::AutodiffBackend;
use burn::train::LearnerSummary;
use burn::train::metric::MetricDefinition;
use burn::train::metric::store::EventStoreClient;
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn::train::{
    EventProcessorTraining, InferenceStep, Learner, LearnerEvent, LearningCheckpointer,
    LearningComponentsTypes, SupervisedLearningStrategy, SupervisedTrainingEventProcessor,
    TrainLoader, TrainingComponents, TrainingItem, TrainingModel, TrainingStrategy, ValidLoader,
};
use wildfire_backend::collective::CollectiveBackend;
use wildfire_backend::comm::{ProcessGroup, split_ranges};
use wildfire_backend::kernels::adamw::FusedAdamW;

use crate::dp::{self, DEFAULT_BUCKET_BYTES, FlatLayout};
use crate::fsdp::{
    ShardError, ZeroStage, gather_units, gather_units_within, reduce_scatter_unit_grads,
    shard_units, unit_params,
};
use crate::grad_norm::{GradNormMetric, GradNorms};
use crate::mesh::{Mesh, MeshError, ParallelDims};
use crate::moments::{
    AdaptorPositions, MomentPiece, SavedMoments, WholeMoments, restore_zero, zero_pieces,
};
use crate::offload::PlacedAdamW;
use crate::pp::graphs_lock;
use crate::replicas::{broadcast_parameters, verify_replicas};
use crate::update::{
    StepOptions, Update, UpdateGroups, lock, module_inner_device, one_device_grads, zero_optimizer,
};

/// Why [`DataParallel`] cannot build an optimizer for a model.
#[derive(Debug, thiserror::Error)]
pub enum StrategyError {
    #[error("{0} updates with its own sharded AdamW: use DataParallel::adamw")]
    OwnsItsOptimizer(ZeroStage),
    #[error(
        "optimizer offload keeps AdamW's moments in host memory: build the optimizer with \
         DataParallel::adamw (a Burn optimizer of your own keeps its state where the parameters \
         are)"
    )]
    Offload,
    #[error(transparent)]
    Shard(#[from] ShardError),
}

/// The burn-train strategy of data parallelism (DDP or ZeRO 1/2/3): see the module doc.
#[derive(Debug, Clone)]
pub struct DataParallel {
    mesh: Mesh,
    bucket_bytes: usize,
    max_norm: f64,
    offload: bool,
    grad_norms: GradNorms,
}

impl DataParallel {
    /// Data parallelism over `mesh`'s data-parallel group, as `mesh.dims().zero` says.
    pub fn new(mesh: Mesh) -> Self {
        Self {
            mesh,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            max_norm: 0.0,
            offload: false,
            grad_norms: GradNorms::default(),
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

    /// The global gradient norm of every step (before clipping) as a burn-train metric:
    /// `.metric_train_numeric(strategy.grad_norm_metric())`.
    pub fn grad_norm_metric(&self) -> GradNormMetric {
        self.grad_norms.metric()
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
    /// `adamw` (bit for bit Burn's AdamW; [`PlacedAdamW`], whose moments offload keeps in host
    /// memory) after DDP's all-reduce under stage 0 and on this rank's rows under stage 3, the
    /// sharded flat AdamW under stages 1 and 2. Its checkpoints resume under every stage.
    pub fn adamw<A, M>(
        &self,
        model: &M,
        adamw: FusedAdamW,
    ) -> Result<ParallelOptimizer<A, OptimizerAdaptor<PlacedAdamW, M, A>>, StrategyError>
    where
        A: AutodiffBackend + CollectiveBackend,
        M: AutodiffModule<A>,
    {
        let stage = self.mesh.dims().zero;
        if matches!(stage, ZeroStage::Replicated | ZeroStage::ShardParameters) {
            let placed = PlacedAdamW::new(adamw, self.offload);
            let mut optimizer = self.by_tensor(model, OptimizerAdaptor::from(placed))?;
            let units = (stage == ZeroStage::ShardParameters).then(|| self.mesh.data());
            optimizer.moments = Some(Arc::new(AdaptorMoments {
                positions: Mutex::new(AdaptorPositions::new(model, units)),
                device: module_inner_device(model),
                offload: self.offload,
                pieces: AdaptorPositions::pieces,
                restore: AdaptorPositions::restore,
            }));
            return Ok(optimizer);
        }
        let zero = zero_optimizer(
            model,
            stage,
            self.mesh.data().clone(),
            FlatLayout::of_module(model, self.bucket_bytes),
            (adamw.clone(), adamw),
            self.offload,
        );
        Ok(self.optimizer(Update::sharded(zero)))
    }

    /// Any Burn optimizer for `model`, stepped after DDP's all-reduce (ZeRO 0) or on this
    /// rank's rows of the units (ZeRO 3). ZeRO 1 and 2 own their AdamW, and only AdamW
    /// offloads: see [`Self::adamw`].
    pub fn with_optimizer<A, M, O>(
        &self,
        model: &M,
        optimizer: O,
    ) -> Result<ParallelOptimizer<A, O>, StrategyError>
    where
        A: AutodiffBackend + CollectiveBackend,
        M: AutodiffModule<A>,
        O: Optimizer<M, A>,
    {
        if self.offload {
            return Err(StrategyError::Offload);
        }
        self.by_tensor(model, optimizer)
    }

    /// `optimizer` stepping the model's tensors as they are held: whole (ZeRO 0) or a unit's
    /// rows (ZeRO 3).
    fn by_tensor<A, M, O>(
        &self,
        model: &M,
        optimizer: O,
    ) -> Result<ParallelOptimizer<A, O>, StrategyError>
    where
        A: AutodiffBackend + CollectiveBackend,
        M: AutodiffModule<A>,
        O: Optimizer<M, A>,
    {
        let update = match self.mesh.dims().zero {
            ZeroStage::Replicated => {
                Update::replicated(optimizer, FlatLayout::of_module(model, self.bucket_bytes))
            }
            ZeroStage::ShardParameters => {
                let (outside, rows) = self.split_by_units::<A, M>(model)?;
                Update::by_units(optimizer, outside, rows)
            }
            stage => return Err(StrategyError::OwnsItsOptimizer(stage)),
        };
        Ok(self.optimizer(update))
    }

    /// ZeRO 3 by units for `model`, where it can run here: the buckets of the parameters
    /// outside its units, and the elements this rank will hold of those inside.
    fn split_by_units<A, M>(&self, model: &M) -> Result<(FlatLayout, usize), ShardError>
    where
        A: AutodiffBackend + CollectiveBackend,
        M: AutodiffModule<A>,
    {
        let data = self.mesh.data();
        if !A::recomputes_gathers() {
            return Err(ShardError::KeepsGathers);
        }
        let units = unit_params(model);
        if units.is_empty() {
            return Err(ShardError::NoUnits);
        }
        let (mut outside, mut rows) = (Vec::new(), 0);
        for spec in dp::param_specs(model) {
            if units.contains(&spec.id) {
                let range = split_ranges(spec.shape[0], data.size())[data.rank()].clone();
                rows += range.len() * spec.numel() / spec.shape[0].max(1);
            } else {
                outside.push(spec);
            }
        }
        Ok((FlatLayout::new(&outside, self.bucket_bytes), rows))
    }

    /// Whether the Learner's model keeps its units whole under ZeRO 3: on thread ranks, which
    /// cannot communicate inside their forward and backward passes (they run them one at a
    /// time under the process-wide autodiff lock). Each optimizer step then cuts the units to
    /// this rank's rows, reduce-scatters their gradients, steps the rows and gathers them
    /// again: ZeRO 3's arithmetic without its memory saving (threads share one process's memory
    /// anyway).
    fn units_stay_whole(&self) -> bool {
        let data = self.mesh.data();
        self.mesh.dims().zero == ZeroStage::ShardParameters
            && data.size() > 1
            && data.transport_name() == "local"
    }

    fn optimizer<A: AutodiffBackend, O>(&self, update: Update<A, O>) -> ParallelOptimizer<A, O> {
        ParallelOptimizer {
            update: Arc::new(update),
            mesh: self.mesh.clone(),
            max_norm: self.max_norm,
            units_whole: self.units_stay_whole(),
            moments: None,
            saved: Arc::default(),
            trained: Arc::default(),
            grad_norms: self.grad_norms.clone(),
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
    /// ZeRO 3 on thread ranks: the model comes and goes with its units whole (see
    /// `DataParallel::units_stay_whole`).
    units_whole: bool,
    /// How the moments of `O` become a checkpoint's pieces and back, where `O` is Burn's
    /// adaptor over [`PlacedAdamW`] (built by [`DataParallel::adamw`]).
    moments: Option<Arc<AdaptorMoments<A, O>>>,
    /// A checkpoint's moments, restored at the next step (the model it resumes gives their
    /// parameters' ids and device).
    saved: Arc<Mutex<Option<SavedMoments<A>>>>,
    /// Whether a step followed the model the Learner trains since the optimizer was built or
    /// loaded a record.
    trained: Arc<AtomicBool>,
    grad_norms: GradNorms,
}

/// The moments of Burn's optimizer adaptor over [`PlacedAdamW`] (`O`) by position.
struct AdaptorMoments<A: AutodiffBackend, O> {
    positions: Mutex<AdaptorPositions>,
    /// The model's device (of its inner backend), where restored moments go.
    device: Device<A::InnerBackend>,
    /// Whether the moments live in host memory.
    offload: bool,
    pieces: ReadPieces<A, O>,
    restore: RestorePieces<A, O>,
}

/// [`AdaptorPositions::pieces`] for the adaptor `O`.
type ReadPieces<A, O> = fn(&AdaptorPositions, &O, bool, &InnerDevice<A>) -> Vec<MomentPiece<A>>;

/// [`AdaptorPositions::restore`] for the adaptor `O`.
type RestorePieces<A, O> = fn(&AdaptorPositions, O, &WholeMoments, &InnerDevice<A>, bool) -> O;

/// The device of `A`'s inner backend.
type InnerDevice<A> = Device<<A as AutodiffBackend>::InnerBackend>;

impl<A: AutodiffBackend, O> Clone for ParallelOptimizer<A, O> {
    fn clone(&self) -> Self {
        Self {
            update: self.update.clone(),
            mesh: self.mesh.clone(),
            max_norm: self.max_norm,
            units_whole: self.units_whole,
            moments: self.moments.clone(),
            saved: self.saved.clone(),
            trained: self.trained.clone(),
            grad_norms: self.grad_norms.clone(),
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
    /// Follows a model whose record was loaded (it took the record's parameter ids), takes
    /// its parameters as the sharded optimizer's master copy where it keeps one, and restores
    /// a loaded checkpoint's moments.
    fn follow<M: AutodiffModule<A>>(&self, module: &M)
    where
        O: Clone,
    {
        let specs = dp::param_specs(module);
        if let Some(moments) = &self.moments {
            lock(&moments.positions).follow(&specs);
        }
        let rebound = match &*self.update {
            Update::Replicated { layout, .. } => {
                let units = self.update.held_by_rows(module);
                let specs: Vec<_> = (specs.into_iter())
                    .filter(|spec| !units.contains(&spec.id))
                    .collect();
                let mut layout = lock(layout);
                match layout.matches(&specs) {
                    true => Ok(()),
                    false => layout.rebind(&specs),
                }
            }
            Update::Sharded(zero) => {
                let mut zero = lock(zero);
                let rebound = match zero.layout().matches(&specs) {
                    true => Ok(()),
                    false => zero.rebind(&specs).map_err(|e| e.to_string()),
                };
                // The start's broadcast or a loaded checkpoint replaced the parameters the
                // master copy was taken from (it is never read between then and here).
                if rebound.is_ok() && !self.trained.swap(true, Ordering::Relaxed) {
                    zero.set_params(&dp::flat_params(module));
                }
                rebound
            }
        };
        if let Err(error) = rebound {
            panic!("data parallelism: the model no longer matches its optimizer: {error}");
        }
        if let Some(saved) = lock(&self.saved).take()
            && let Err(error) = self.restore(saved)
        {
            panic!("data parallelism, resuming the optimizer's moments: {error}");
        }
    }

    /// Puts a checkpoint's moments where this stage holds them.
    fn restore(&self, saved: SavedMoments<A>) -> Result<(), String>
    where
        O: Clone,
    {
        let data = self.mesh.data();
        match (&*self.update, &self.moments) {
            (Update::Sharded(zero), _) => {
                let mut zero = lock(zero);
                let numels: Vec<usize> = (zero.layout().params_in_order().iter())
                    .map(|p| p.numel())
                    .collect();
                let whole = WholeMoments::assemble(saved, &numels, data)?;
                restore_zero(&mut zero, &whole).map_err(|e| e.to_string())
            }
            (Update::Replicated { optimizer, .. }, Some(moments)) => {
                let positions = lock(&moments.positions);
                let whole = WholeMoments::assemble(saved, &positions.numels(), data)?;
                let mut optimizer = lock(optimizer);
                let restored = optimizer.clone();
                let device = &moments.device;
                *optimizer =
                    (moments.restore)(&positions, restored, &whole, device, moments.offload);
                Ok(())
            }
            (Update::Replicated { .. }, None) => {
                Err("this optimizer keeps its own record, not AdamW moments".to_string())
            }
        }
    }
}

impl<A, M, O> Optimizer<M, A> for ParallelOptimizer<A, O>
where
    A: AutodiffBackend,
    A::InnerBackend: CollectiveBackend,
    M: AutodiffModule<A>,
    O: Optimizer<M, A> + Clone,
{
    /// The ZeRO stage and data-parallel degree that saved it, then either this rank's pieces of
    /// the AdamW moments (see [`crate::moments`]; an optimizer built by
    /// [`DataParallel::adamw`], under every stage) or the Burn optimizer's own record (any other
    /// optimizer, under DDP or ZeRO 3).
    type Record = (usize, usize, Option<O::Record>, Vec<MomentPiece<A>>);

    fn step(&mut self, lr: f64, module: M, mut grads: GradientsParams) -> M {
        let data = self.mesh.data();
        let module = match self.units_whole {
            true => shard_units(module, data)
                .and_then(|rows| reduce_scatter_unit_grads(&rows, &mut grads, data).map(|()| rows))
                .unwrap_or_else(|e| panic!("ZeRO 3 on thread ranks, cutting the units: {e}")),
            false => module,
        };
        self.follow(&module);
        let ranks = self.mesh.data().size() as f64;
        let options = StepOptions {
            // The gradients are those of the sum of `ranks` batch means: unscale by `ranks`.
            loss_scale: ranks,
            ..StepOptions::new(lr, self.max_norm)
        };
        let groups = UpdateGroups::from(&self.mesh);
        let module = match self.update.update(groups, module, grads, options) {
            Ok((module, stats)) => {
                self.grad_norms
                    .note((!stats.skipped).then_some(stats.grad_norm));
                module
            }
            Err(error) => panic!("data-parallel optimizer step: {error}"),
        };
        match self.units_whole {
            true => whole_units(module, data),
            false => module,
        }
    }

    fn to_record(&self) -> Self::Record {
        let stage = self.update.stage();
        let data = self.mesh.data();
        let (own, pieces) = match (&*self.update, &self.moments) {
            (Update::Sharded(zero), _) => match zero_pieces(&lock(zero)) {
                Ok(pieces) => (None, pieces),
                Err(error) => panic!("saving the data-parallel optimizer: {error}"),
            },
            (Update::Replicated { optimizer, .. }, Some(moments)) => {
                // Sharded stages write a parameter every rank holds whole from rank 0 only.
                let writes_whole = stage == ZeroStage::Replicated || data.rank() == 0;
                let positions = lock(&moments.positions);
                let optimizer = lock(optimizer);
                let device = &moments.device;
                (
                    None,
                    (moments.pieces)(&positions, &optimizer, writes_whole, device),
                )
            }
            (Update::Replicated { optimizer, .. }, None) => {
                (Some(lock(optimizer).to_record()), vec![])
            }
        };
        (usize::from(stage.level()), data.size(), own, pieces)
    }

    fn load_record(self, (saved, ranks, own, pieces): Self::Record) -> Self {
        self.trained.store(false, Ordering::Relaxed);
        let stage = self.update.stage();
        let saved = u8::try_from(saved).ok().and_then(ZeroStage::from_level);
        let saved_name =
            || saved.map_or_else(|| "an unknown ZeRO stage".to_string(), |s| s.to_string());
        match (own, &*self.update, &self.moments) {
            (Some(record), Update::Replicated { optimizer, .. }, None) if saved == Some(stage) => {
                let mut optimizer = lock(optimizer);
                *optimizer = optimizer.clone().load_record(record);
            }
            (Some(_), _, _) => panic!(
                "loading the data-parallel optimizer: the checkpoint holds a Burn optimizer's own \
                 record, saved under {}; it resumes under that stage with the optimizer that \
                 saved it, and this run is {stage}",
                saved_name()
            ),
            (None, Update::Sharded(_), _) | (None, Update::Replicated { .. }, Some(_)) => {
                *lock(&self.saved) = Some(SavedMoments {
                    whole: saved == Some(ZeroStage::Replicated),
                    ranks,
                    pieces,
                });
            }
            (None, Update::Replicated { .. }, None) => panic!(
                "loading the data-parallel optimizer: the checkpoint holds AdamW moments (saved \
                 under {} by an optimizer of DataParallel::adamw), but this run's optimizer was \
                 built by DataParallel::with_optimizer; build it with DataParallel::adamw",
                saved_name()
            ),
        }
        self
    }

    fn step_multi(&mut self, lr: f64, module: M, grads: MultiGradientsParams) -> M {
        match one_device_grads(grads) {
            Ok(grads) => self.step(lr, module, grads),
            Err(error) => panic!("{error}"),
        }
    }
}

impl<LC: LearningComponentsTypes> From<DataParallel> for TrainingStrategy<LC>
where
    LC::Optimizer: SynchronizesGradients,
    InnerBackend<LC>: CollectiveBackend,
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

/// The backend under `LC`'s autodiff backend.
type InnerBackend<LC> = <<LC as LearningComponentsTypes>::Backend as AutodiffBackend>::InnerBackend;

impl<LC: LearningComponentsTypes> SupervisedLearningStrategy<LC> for DataParallel
where
    LC::Optimizer: SynchronizesGradients,
    InnerBackend<LC>: CollectiveBackend,
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
        // ZeRO 3 whose units gather in their forward; on thread ranks the optimizer shards them.
        let by_units =
            self.mesh.dims().zero == ZeroStage::ShardParameters && !self.units_stay_whole();
        identical_replicas(&mut learner, data);
        if by_units {
            let sharded = shard_units(learner.model(), data)
                .unwrap_or_else(|e| panic!("data parallelism at start: {e}"));
            load_model(&mut learner, sharded);
        }
        let scope = by_units.then(|| gather_units_within(data));
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
                leader.then_some((&mut processor, &self.grad_norms)),
            );
            if leader || by_units {
                valid_epoch(
                    &learner,
                    &valid,
                    &progress,
                    leader.then_some(&mut processor),
                );
            }
            barrier(self.mesh.world(), "after validation");
            if let Some(checkpointer) = &mut checkpointer {
                let units = by_units.then_some(data);
                save(
                    &mut learner,
                    checkpointer,
                    epoch,
                    &components.event_store,
                    units,
                );
            }
            if interrupter.should_stop() {
                break;
            }
        }
        drop(scope);
        let model = match by_units {
            true => whole_units(learner.model(), data),
            false => learner.model(),
        };
        (model, processor)
    }
}

/// burn-train's checkpoint of `learner` after `epoch`. Under ZeRO 3 (`units`: the data-parallel
/// group) the model is saved whole, and the learner goes on with its rows.
fn save<LC>(
    learner: &mut Learner<LC>,
    checkpointer: &mut LearningCheckpointer<LC>,
    epoch: usize,
    events: &EventStoreClient,
    units: Option<&ProcessGroup>,
) where
    LC: LearningComponentsTypes,
    InnerBackend<LC>: CollectiveBackend,
{
    let Some(data) = units else {
        return checkpointer.checkpoint(learner, epoch, events);
    };
    let rows = learner.model();
    load_model(learner, whole_units(rows.clone(), data));
    checkpointer.checkpoint(learner, epoch, events);
    load_model(learner, rows);
}

/// The learner's model replaced by `model` (its record loaded: parameters become new graph
/// leaves, under the autodiff lock).
fn load_model<LC: LearningComponentsTypes>(learner: &mut Learner<LC>, model: TrainingModel<LC>) {
    let _lock = graphs_lock();
    learner.load_model(model.into_record());
}

/// `model` with its units' parameters whole (ZeRO 3), for a checkpoint or the trained model.
fn whole_units<A, M>(model: M, data: &ProcessGroup) -> M
where
    A: AutodiffBackend,
    A::InnerBackend: CollectiveBackend,
    M: AutodiffModule<A>,
{
    gather_units(model, data).unwrap_or_else(|e| panic!("ZeRO 3, gathering the model: {e}"))
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
        Ok(model) => load_model(learner, model),
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

/// One epoch of training on this rank's share; `processor` on rank 0 only, with the log of the
/// steps' gradient norms it files for the metric.
fn train_epoch<LC: LearningComponentsTypes>(
    learner: &mut Learner<LC>,
    loader: &TrainLoader<LC>,
    accumulation: Option<usize>,
    epoch: &Progress,
    mut processor: Option<(&mut SupervisedTrainingEventProcessor<LC>, &GradNorms)>,
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
        if let Some((processor, norms)) = processor.as_mut() {
            norms.file(epoch.items_processed, iteration);
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
    if let Some((processor, _)) = processor {
        processor.process_train(LearnerEvent::EndEpoch(epoch.items_processed));
    }
}

/// Validation over the whole validation set; `processor` (rank 0's) records it.
fn valid_epoch<LC: LearningComponentsTypes>(
    learner: &Learner<LC>,
    loader: &ValidLoader<LC>,
    epoch: &Progress,
    mut processor: Option<&mut SupervisedTrainingEventProcessor<LC>>,
) {
    let model = learner.model().valid();
    let mut items = loader.iter();
    let mut iteration = 0;
    while let Some(item) = items.next() {
        iteration += 1;
        let output = model.step(item);
        if let Some(processor) = processor.as_deref_mut() {
            let item = TrainingItem::new(
                output,
                items.progress(),
                epoch.clone(),
                Some(iteration),
                None,
            );
            processor.process_valid(LearnerEvent::ProcessedItem(item));
        }
    }
    if let Some(processor) = processor {
        processor.process_valid(LearnerEvent::EndEpoch(epoch.items_processed));
    }
}
