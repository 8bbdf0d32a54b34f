//! [`TensorParallel`]: where a layer, or a whole model, stands in its tensor-parallel group. A
//! field of this type holds no parameter; [`super::apply_plan`] fills it in (the group, the
//! layer's style under the plan, the sequence dimension) while it splits the parameters, and
//! the forward reads it. A Burn module's type is fixed when it is written, so this is how a plan
//! given at run time reaches layers a user wrote once: the same model runs serial (nothing
//! filled in) and at any tensor-parallel degree.

use std::marker::PhantomData;
use std::ops::Range;

use burn::module::{
    AutodiffModule, Content, Devices, EmptyRecord, HasAutodiffModule, Module, ModuleDisplay,
    ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor};
use wildfire_backend::collective::{
    CollectiveBackend, all_gather_from_sequence_region, copy_to_parallel_region,
    gather_from_parallel_region, scatter_to_parallel_region,
};
use wildfire_backend::comm::{CommError, ProcessGroup};
use wildfire_backend::kernels::cross_entropy::{
    FusedCrossEntropyBackend, HeadLayout, LinearCrossEntropy,
};

use super::plan::{TpStyle, vocabulary_share};
use super::walk::{self, Applied, Layer};

/// A collective inside a layer's forward. The forward has no error path (Burn's modules return
/// tensors), so a failed collective (a peer that died) ends this rank with its cause.
pub(crate) fn collective<T>(result: Result<T, CommError>) -> T {
    result.unwrap_or_else(|error| panic!("tensor-parallel collective failed: {error}"))
}

/// A layer's or a model's place in its tensor-parallel group; nothing until a plan is applied.
/// Put one in a model (`TensorParallel::new()`) whose forward enters or leaves the
/// sequence-parallel region, or computes a vocabulary-parallel loss.
pub struct TensorParallel<B: Backend> {
    layer: Layer,
    applied: Option<Applied>,
    backend: PhantomData<fn() -> B>,
}

impl<B: Backend> TensorParallel<B> {
    /// A model's place: not split until a plan is applied.
    pub fn new() -> Self {
        Self::for_layer(Layer::Model)
    }

    pub(crate) fn for_layer(layer: Layer) -> Self {
        Self {
            layer,
            applied: None,
            backend: PhantomData,
        }
    }

    pub(crate) fn with_applied(self, applied: Applied) -> Self {
        Self {
            applied: Some(applied),
            ..self
        }
    }

    /// The same slot on another backend (the autodiff and inner modules share it).
    fn on<C: Backend>(&self) -> TensorParallel<C> {
        TensorParallel {
            layer: self.layer,
            applied: self.applied.clone(),
            backend: PhantomData,
        }
    }

    /// The tensor-parallel group, when a plan put this on more than one rank.
    pub fn group(&self) -> Option<&ProcessGroup> {
        self.applied
            .as_ref()
            .map(|applied| &applied.group)
            .filter(|group| group.size() > 1)
    }

    /// This rank and the group's size: `(0, 1)` when not split.
    pub fn rank_and_size(&self) -> (usize, usize) {
        self.group().map_or((0, 1), |g| (g.rank(), g.size()))
    }

    /// The layer's split style: column, row or vocabulary rows, where a plan split it over more
    /// than one rank; `None` where it is whole.
    pub fn style(&self) -> Option<TpStyle> {
        self.group()?;
        let style = self.applied.as_ref()?.style?;
        let split = match style {
            TpStyle::Column { .. } | TpStyle::ColumnHeads { .. } | TpStyle::Row => true,
            TpStyle::VocabRows | TpStyle::VocabColumns => true,
            TpStyle::Replicated | TpStyle::SequenceRegion | TpStyle::HeadShared => false,
        };
        split.then_some(style)
    }

    /// The rows of the whole table this embedding holds, where a plan split it.
    pub(crate) fn part(&self) -> Option<Range<usize>> {
        self.style()?;
        self.applied.as_ref()?.part.clone()
    }

    /// The dimension along which the sequence-parallel region's activations are split, under
    /// sequence parallelism over more than one rank.
    pub fn sequence_dim(&self) -> Option<usize> {
        self.group()?;
        self.applied.as_ref()?.sequence_dim
    }

    /// The part of the whole activation along the sequence dimension that a tensor of `local`
    /// entries along it holds: this rank's under sequence parallelism (the sequence divides by
    /// the group), `None` (the whole) otherwise.
    pub fn sequence_part(&self, local: usize) -> Option<ActivationPart> {
        let dim = self.sequence_dim()?;
        let (rank, size) = self.rank_and_size();
        Some(ActivationPart {
            dim,
            range: rank * local..(rank + 1) * local,
            whole: local * size,
        })
    }
}

/// A part of an activation of the serial model: `range` of its `whole` entries along `dim`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActivationPart {
    pub dim: usize,
    pub range: Range<usize>,
    pub whole: usize,
}

impl<B: CollectiveBackend> TensorParallel<B> {
    /// Enters the sequence-parallel region: under sequence parallelism keeps this rank's part of
    /// `x` along the sequence dimension (backward: all-gather); `x` itself otherwise.
    pub fn enter_sequence_region<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        match (self.group(), self.sequence_dim()) {
            (Some(group), Some(dim)) => collective(scatter_to_parallel_region(x, group, dim)),
            _ => x,
        }
    }

    /// Leaves the sequence-parallel region: under sequence parallelism all-gathers `x` along the
    /// sequence dimension (backward: this rank's part); `x` itself otherwise.
    pub fn leave_sequence_region<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        match (self.group(), self.sequence_dim()) {
            (Some(group), Some(dim)) => collective(gather_from_parallel_region(x, group, dim)),
            _ => x,
        }
    }

    /// Brings `x` into the tensor-parallel region as a column-parallel layer's input enters it
    /// (for a layer the model computes itself, e.g. a tied head's product with the
    /// vocabulary-parallel table): all-gathered along the sequence under sequence parallelism,
    /// else through `f` (identity forward, all-reduce backward); `x` itself when not split.
    pub fn enter_parallel_region<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        match (self.group(), self.sequence_dim()) {
            (Some(group), Some(dim)) => collective(all_gather_from_sequence_region(x, group, dim)),
            (Some(group), None) => collective(copy_to_parallel_region(x, group)),
            _ => x,
        }
    }
}

impl<B: FusedCrossEntropyBackend> TensorParallel<B> {
    /// The summed token loss of a language-model head the model computes itself (a tied head,
    /// `weight` its embedding table `[V_r, d]` or a copy of it, in `layout`), scored against
    /// `targets` by the fused cross-entropy that never holds the logits
    /// (`wildfire_backend::kernels::cross_entropy`): a one-element f32 tensor, the same on every
    /// rank. Under a plan `x` enters the tensor-parallel region as
    /// [`Self::enter_parallel_region`] says, and `weight` is this rank's part of a vocabulary of
    /// `vocab` tokens split as the plan splits one ([`vocabulary_share`]).
    ///
    /// # Panics
    /// When the shapes disagree (see `LinearCrossEntropy::loss_sum`).
    pub fn head_cross_entropy_sum<const D: usize, const E: usize>(
        &self,
        x: Tensor<B, D>,
        (weight, layout): (Tensor<B, 2>, HeadLayout),
        vocab: usize,
        targets: Tensor<B, E, Int>,
        loss: &LinearCrossEntropy,
    ) -> Tensor<B, 1> {
        let loss = match self.group() {
            Some(group) => {
                let part = vocabulary_share(vocab, group.rank(), group.size());
                loss.clone().with_vocab_shard(group, part.start)
            }
            None => loss.clone(),
        };
        let x = self.enter_parallel_region(x);
        collective(loss.loss_sum(x, weight, layout, targets))
    }
}

impl<B: Backend> Default for TensorParallel<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> Clone for TensorParallel<B> {
    fn clone(&self) -> Self {
        self.on()
    }
}

impl<B: Backend> std::fmt::Debug for TensorParallel<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallel")
            .field("layer", &self.layer)
            .field("applied", &self.applied)
            .finish()
    }
}

/// No parameters and no record: the plan is applied again when a model is built (a checkpoint
/// stores parameters by name, the split is the run's). Visiting and mapping report the slot to a
/// plan being applied ([`walk`]); anything else leaves it as it is.
impl<B: Backend> Module<B> for TensorParallel<B> {
    type Record = EmptyRecord;

    fn visit<V: ModuleVisitor<B>>(&self, _visitor: &mut V) {
        walk::survey_slot(self.layer);
    }

    fn map<M: ModuleMapper<B>>(self, _mapper: &mut M) -> Self {
        match walk::fill_slot() {
            Some(applied) => self.with_applied(applied),
            None => self,
        }
    }

    fn load_record(self, _record: Self::Record) -> Self {
        self
    }

    fn into_record(self) -> Self::Record {
        EmptyRecord::new()
    }

    fn to_device(self, _device: &B::Device) -> Self {
        self
    }

    fn fork(self, _device: &B::Device) -> Self {
        self
    }

    fn collect_devices(&self, devices: Devices<B>) -> Devices<B> {
        devices
    }
}

impl<B: AutodiffBackend> AutodiffModule<B> for TensorParallel<B> {
    type InnerModule = TensorParallel<B::InnerBackend>;

    fn valid(&self) -> Self::InnerModule {
        self.on()
    }

    fn from_inner(module: Self::InnerModule) -> Self {
        module.on()
    }
}

impl<B: AutodiffBackend> HasAutodiffModule<B> for TensorParallel<B::InnerBackend> {
    type TrainModule = TensorParallel<B>;
}

impl<B: Backend> ModuleDisplayDefault for TensorParallel<B> {
    fn content(&self, content: Content) -> Option<Content> {
        let text = match self.style() {
            Some(style) => format!("{style} over {}", self.rank_and_size().1),
            None => "whole".to_string(),
        };
        content.add_formatted(&text).optional()
    }
}

impl<B: Backend> ModuleDisplay for TensorParallel<B> {}
