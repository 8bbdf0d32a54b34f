//! A Burn user's classifier under data parallelism: an MLP on points it generates, trained
//! with Burn's `SupervisedTraining` and `Learner`, the user's own `TrainStep` and
//! `InferenceStep`, and wildfire's [`DataParallel`] strategy. What is wildfire's here: the
//! backend type (`Autodiff<Parallel<Flex>, BalancedCheckpointing>` instead of `Autodiff<Flex>`;
//! the checkpointing only matters to ZeRO 3), the hidden blocks wrapped in [`ShardedUnit`]
//! (which ZeRO 3 shards; under the other stages a unit is its block), the optimizer built
//! through the strategy, the strategy line, and the per-rank artifact directory. The hidden
//! layers are wildfire's `ParallelLinear` and the model keeps a `TensorParallel`, so that the
//! same model also runs tensor-parallel by a plan ([`crate::tensor_parallel`]); here, unsplit,
//! they compute exactly what Burn's `Linear` computes.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::lr_scheduler::constant::ConstantLr;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use burn::train::metric::LossMetric;
use burn::train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
};
use wildfire_backend::collective::CollectiveBackend;
use wildfire_backend::kernels::adamw::FusedAdamW;
use wildfire_parallel::DataParallel;
use wildfire_parallel::fsdp::ShardedUnit;
use wildfire_parallel::pp::graphs_lock;
use wildfire_parallel::strategy::{Silent, StrategyError};
use wildfire_parallel::tp::{ParallelLinear, TensorParallel};

use crate::checkpoints::Checkpoints;

/// Input features and classes.
pub const FEATURES: usize = 16;
pub const CLASSES: usize = 4;

/// The hidden layers' size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Shape {
    /// Units per hidden layer.
    pub width: usize,
    /// Hidden `width × width` blocks after the input layer.
    pub blocks: usize,
}

impl Default for Shape {
    fn default() -> Self {
        Self {
            width: 32,
            blocks: 2,
        }
    }
}

/// An input layer, `blocks` hidden blocks (each a ZeRO 3 unit) and an output layer, with ReLUs
/// between them. `log` records each training batch's loss (this rank's), so a run can be
/// compared step by step; it is not a parameter.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    input: Linear<B>,
    blocks: Vec<ShardedUnit<B, Block<B>>>,
    output: Linear<B>,
    activation: Relu,
    /// Where a tensor-parallel plan put the model (see [`crate::tensor_parallel`]).
    tp: TensorParallel<B>,
    #[module(skip)]
    log: StepLog,
}

/// A hidden layer and its ReLU.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    linear: ParallelLinear<B>,
    activation: Relu,
}

impl<B: CollectiveBackend> Block<B> {
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.activation.forward(self.linear.forward(x))
    }
}

/// What each training step records; clones share it: the batch's loss, and an optional probe
/// called as each step starts (a test's heap measurement).
#[derive(Clone, Default)]
pub struct StepLog {
    losses: Arc<Mutex<Vec<f32>>>,
    probe: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl std::fmt::Debug for StepLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepLog")
            .field("steps", &self.losses().len())
            .field("probe", &self.probe.is_some())
            .finish()
    }
}

impl StepLog {
    /// A log whose steps call `probe` as they start.
    pub fn probed(probe: impl Fn() + Send + Sync + 'static) -> Self {
        Self {
            probe: Some(Arc::new(probe)),
            ..Self::default()
        }
    }

    pub fn losses(&self) -> Vec<f32> {
        self.losses.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

impl<B: Backend> Mlp<B> {
    pub fn new(device: &B::Device, shape: Shape, log: StepLog) -> Self {
        let block = || Block {
            linear: LinearConfig::new(shape.width, shape.width)
                .init(device)
                .into(),
            activation: Relu::new(),
        };
        Self {
            input: LinearConfig::new(FEATURES, shape.width).init(device),
            blocks: (0..shape.blocks)
                .map(|_| ShardedUnit::new(block()))
                .collect(),
            output: LinearConfig::new(shape.width, CLASSES).init(device),
            activation: Relu::new(),
            tp: TensorParallel::new(),
            log,
        }
    }
}

impl<B: Backend> Mlp<B> {
    /// The layers, for a cut into pipeline stages ([`crate::pipeline::stages`]): the input
    /// layer, the hidden blocks, the output layer and the activation.
    #[allow(clippy::type_complexity)]
    pub fn into_parts(self) -> (Linear<B>, Vec<ShardedUnit<B, Block<B>>>, Linear<B>, Relu) {
        (self.input, self.blocks, self.output, self.activation)
    }
}

impl<B: CollectiveBackend> Mlp<B> {
    /// Logits of `inputs: [points, FEATURES]`. Under sequence parallelism the activations
    /// between the tensor-parallel layer pairs hold this rank's part of the points.
    pub fn forward(&self, inputs: Tensor<B, 2>) -> Tensor<B, 2> {
        let x = self.activation.forward(self.input.forward(inputs));
        let mut x = self.tp.enter_sequence_region(x);
        for block in &self.blocks {
            x = block.forward(x, |block, x| block.forward(x));
        }
        self.output.forward(self.tp.leave_sequence_region(x))
    }

    /// The batch's mean cross-entropy and the logits.
    pub fn classify(&self, batch: Points<B>) -> ClassificationOutput<B> {
        let logits = self.forward(batch.inputs);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, logits, batch.targets)
    }
}

impl<B: Backend> Mlp<B> {
    /// Every parameter's values, flattened, in registration order.
    pub fn parameters(&self) -> Vec<f32> {
        parameters(self)
    }

    /// The model drawn from `seed`, every parameter now, in registration order (Burn draws a
    /// parameter on its first use): it depends on the seed alone, not on which parts a plan
    /// splits or a pipeline stage uses first. Ranks that are threads of one process share
    /// Burn's RNG and autodiff registry: they call this under `pp::graphs_lock`.
    pub fn drawn(device: &B::Device, shape: Shape, seed: u64, log: StepLog) -> Self {
        B::seed(device, seed);
        let model = Self::new(device, shape, log);
        parameters(&model);
        model
    }
}

/// Every parameter's values of `module`, flattened, in registration order.
pub fn parameters<B: Backend, M: Module<B>>(module: &M) -> Vec<f32> {
    struct Values(Vec<f32>);
    impl<B: Backend> ModuleVisitor<B> for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().into_data().convert::<f32>();
            self.0.extend(data.to_vec::<f32>().unwrap_or_default());
        }
    }
    let mut values = Values(Vec::new());
    module.visit(&mut values);
    values.0
}

impl<B: AutodiffBackend + CollectiveBackend> TrainStep for Mlp<B> {
    type Input = Points<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Points<B>) -> TrainOutput<ClassificationOutput<B>> {
        if let Some(probe) = &self.log.probe {
            probe();
        }
        let output = self.classify(batch);
        if let Ok(mut losses) = self.log.losses.lock() {
            losses.push(output.loss.clone().into_scalar().elem::<f32>());
        }
        TrainOutput::new(self, output.loss.backward(), output)
    }
}

impl<B: CollectiveBackend> InferenceStep for Mlp<B> {
    type Input = Points<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Points<B>) -> ClassificationOutput<B> {
        self.classify(batch)
    }
}

/// A batch of labelled points.
#[derive(Debug, Clone)]
pub struct Points<B: Backend> {
    pub inputs: Tensor<B, 2>,
    pub targets: Tensor<B, 1, Int>,
}

/// One labelled point.
#[derive(Debug, Clone)]
pub struct Point {
    pub features: [f32; FEATURES],
    pub class: i64,
}

/// `len` points drawn from `seed`: features uniform in [−1, 1], the class the largest of four
/// fixed linear scores (so there is something to learn).
#[derive(Debug, Clone)]
pub struct Blobs {
    pub len: usize,
    pub seed: u64,
}

impl Dataset<Point> for Blobs {
    fn get(&self, index: usize) -> Option<Point> {
        if index >= self.len {
            return None;
        }
        let mut state = (self.seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
        let mut features = [0f32; FEATURES];
        for value in &mut features {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *value = (state % 2001) as f32 / 1000.0 - 1.0;
        }
        let score = |class: usize| -> f32 {
            (features.iter().enumerate())
                .map(|(i, x)| x * (((i * 7 + class * 3) % 5) as f32 - 2.0))
                .sum()
        };
        let class = (0..CLASSES)
            .max_by(|a, b| score(*a).total_cmp(&score(*b)))
            .unwrap_or(0) as i64;
        Some(Point { features, class })
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// `inner` reordered so that batch `k` of `ranks · batch` points is the concatenation of batch
/// `k` of every rank's share under [`DataParallel`] (rank `r` trains on points
/// `[r·n/p, (r+1)·n/p)`): the serial run that a data-parallel run equals.
#[derive(Debug, Clone)]
pub struct ConcatenatedBatches<D> {
    pub inner: D,
    pub ranks: usize,
    pub batch: usize,
}

impl<D: Dataset<Point>> Dataset<Point> for ConcatenatedBatches<D> {
    fn get(&self, index: usize) -> Option<Point> {
        let share = self.inner.len() / self.ranks;
        let global = self.ranks * self.batch;
        let (step, within) = (index / global, index % global);
        let (rank, offset) = (within / self.batch, within % self.batch);
        self.inner
            .get(rank * share + step * self.batch + offset)
            .filter(|_| index < self.len())
    }

    fn len(&self) -> usize {
        self.inner.len() / self.ranks * self.ranks
    }
}

#[derive(Debug, Clone)]
struct PointBatcher;

impl<B: Backend> Batcher<B, Point, Points<B>> for PointBatcher {
    fn batch(&self, items: Vec<Point>, device: &B::Device) -> Points<B> {
        let features: Vec<f32> = items.iter().flat_map(|p| p.features).collect();
        let classes: Vec<i64> = items.iter().map(|p| p.class).collect();
        Points {
            inputs: Tensor::from_data(TensorData::new(features, [items.len(), FEATURES]), device),
            targets: Tensor::from_data(TensorData::new(classes, [items.len()]), device),
        }
    }
}

/// A run in a training loop of Burn's pieces (the tensor-parallel and pipeline examples): every
/// rank draws the whole model from `seed` and sees every batch.
#[derive(Debug, Clone)]
pub struct LoopRun {
    pub shape: Shape,
    pub seed: u64,
    /// Points per batch.
    pub batch: usize,
    /// Steps in all (a resumed run takes those after its checkpoint's).
    pub steps: usize,
    pub lr: f64,
    /// Where the run keeps checkpoints and resumes from, if it does.
    pub checkpoints: Option<Checkpoints>,
}

impl LoopRun {
    /// Batch `step` of the points.
    pub fn batch<B: Backend>(&self, step: usize) -> Points<B> {
        let points = Blobs {
            len: self.batch * self.steps,
            seed: 7,
        };
        let items = (step * self.batch..(step + 1) * self.batch)
            .filter_map(|index| points.get(index))
            .collect();
        PointBatcher.batch(items, &B::Device::default())
    }
}

/// What to train.
#[derive(Debug, Clone)]
pub struct Run {
    /// burn-train's artifact directory (rank `r > 0` uses `dir/rank-r`).
    pub dir: PathBuf,
    /// Points per batch on each rank.
    pub batch: usize,
    /// Training points in all (each rank trains on its share).
    pub points: usize,
    pub epochs: usize,
    /// Resume from this epoch's checkpoint (every epoch is checkpointed).
    pub resume: Option<usize>,
    /// The model's initialisation seed (ranks may differ: rank 0's parameters are broadcast).
    pub seed: u64,
    pub lr: f64,
    /// Reorder the training points for a serial run that equals a run on this many ranks.
    pub serial_for_ranks: Option<usize>,
    pub shape: Shape,
    /// Where the steps record their losses (and what they call as they start).
    pub log: StepLog,
}

/// What a run produced on this rank.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Outcome {
    /// This rank's loss of each training batch.
    pub losses: Vec<f32>,
    /// The trained parameters, flattened in registration order.
    pub parameters: Vec<f32>,
}

/// Trains the MLP under `strategy` (every rank calls it) on backend `B`.
pub fn train<B>(strategy: DataParallel, run: &Run) -> Result<Outcome, StrategyError>
where
    B: AutodiffBackend + CollectiveBackend,
    B::InnerBackend: CollectiveBackend,
{
    let device = B::Device::default();
    let model = {
        // Ranks that are threads of one process share Burn's RNG: each seeds and draws its
        // model while no other rank does.
        let _lock = graphs_lock();
        Mlp::<B>::drawn(&device, run.shape, run.seed, run.log.clone())
    };
    let optimizer = strategy.adamw(&model, FusedAdamW::new(0.9, 0.999, 1e-8, 0.01))?;

    let points = Blobs {
        len: run.points,
        seed: 7,
    };
    let valid = Blobs {
        len: run.points / 4,
        seed: 11,
    };
    let train_loader = match run.serial_for_ranks {
        Some(ranks) => DataLoaderBuilder::new(PointBatcher)
            .batch_size(run.batch)
            .build(ConcatenatedBatches {
                inner: points,
                ranks,
                batch: run.batch / ranks,
            }),
        None => DataLoaderBuilder::new(PointBatcher)
            .batch_size(run.batch)
            .build(points),
    };
    let valid_loader = DataLoaderBuilder::new(PointBatcher)
        .batch_size(run.batch)
        .build(valid);

    let dir = strategy.artifact_dir(&run.dir);
    let strategy_rank = strategy.mesh().world().rank();
    let mut training = SupervisedTraining::new(dir, train_loader, valid_loader)
        .metric_train_numeric(LossMetric::new())
        .metric_train_numeric(strategy.grad_norm_metric())
        .metric_valid_numeric(LossMetric::new())
        .with_file_checkpointer(NamedMpkFileRecorder::<FullPrecisionSettings>::new())
        .num_epochs(run.epochs)
        .with_application_logger(None)
        .with_training_strategy(strategy.into());
    if strategy_rank != 0 {
        training = training.renderer(Silent);
    }
    if let Some(epoch) = run.resume {
        training = training.checkpoint(epoch);
    }
    let result = training.launch(Learner::new(model, optimizer, ConstantLr::new(run.lr)));
    Ok(Outcome {
        losses: run.log.losses(),
        parameters: result.model.parameters(),
    })
}
