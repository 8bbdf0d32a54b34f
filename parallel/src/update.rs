//! From a rank's local gradients to updated parameters, for any Burn module, under every
//! data-parallel mode: the reduction over the data-parallel ranks, the global gradient norm and
//! clipping (with fp16's unscaling and skipped steps), and the optimizer step.
//!
//! ```text
//! ZeRO 0 (DDP)   all-reduce in buckets → full gradients on every replica → the caller's Burn
//!                optimizer (any), per tensor
//! ZeRO 1 / 2     all-reduce / reduce-scatter in buckets → owned parts → AdamW on the owned
//!                parts → all-gather the updated parameters
//! ZeRO 3         (the step reduce-scattered already) → AdamW on the owned parts, kept sharded
//! ZeRO 3 by      the parameters inside `ShardedUnit`s are this rank's rows, their gradients
//!   units        reduce-scattered by the backward pass; the others all-reduced as DDP's → the
//!                caller's Burn optimizer (any), per tensor
//! ```
//!
//! The norm is that of the full gradient in every mode: replicated gradients are summed over
//! the ranks of one model replica only (pipeline stages × tensor-parallel parts; each
//! parameter once: the caller names the parameters another rank of the replica counts), owned
//! parts over every rank.

use std::collections::HashSet;
use std::sync::{Mutex, MutexGuard};

use burn::module::{AutodiffModule, ParamId};
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use wildfire_backend::comm::{CommError, ProcessGroup};
use wildfire_backend::kernels::adamw::FusedAdamW;

use crate::clip::{grad_sum_of_squares_where, scale_grads, unscale_and_clip};
pub use crate::device_value::{inner_device_of, module_inner_device};
use crate::device_value::{read_value, sum_over};
use crate::dp::{self, FlatLayout, ReduceStats, SetParams};
use crate::fsdp::{StateBytes, ZeroError, ZeroOptimizer, ZeroStage, unit_params};
use crate::mesh::Mesh;
use crate::pp::graphs_lock;

/// Why an update failed.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Zero(#[from] ZeroError),
    #[error("the Learner ran no optimizer step to report on")]
    NoStep,
    #[error("data parallelism takes one device's gradients per rank, not {0}")]
    Devices(usize),
}

/// The groups an update communicates over.
#[derive(Debug, Clone, Copy)]
pub struct UpdateGroups<'a> {
    /// Every rank of the job.
    pub world: &'a ProcessGroup,
    /// The ranks that hold one model replica between them (pipeline × tensor-parallel).
    pub replica: &'a ProcessGroup,
    /// This rank's data-parallel group.
    pub data: &'a ProcessGroup,
}

impl<'a> From<&'a Mesh> for UpdateGroups<'a> {
    fn from(mesh: &'a Mesh) -> Self {
        Self {
            world: mesh.world(),
            replica: mesh.replica(),
            data: mesh.data(),
        }
    }
}

/// What an update measured: `B` is the backend the gradients live on (an autodiff backend's
/// inner one).
#[derive(Debug, Clone)]
pub struct UpdateStats<B: Backend> {
    /// The global norm of the (unscaled) gradients before clipping, a one-element tensor on
    /// the device (in its widest float; see [`crate::device_value`]): read it when the value is
    /// needed. Not finite when some gradient was infinite or NaN.
    pub grad_norm: Tensor<B, 1>,
    /// Whether the update was skipped because some gradient overflowed. Only an update that
    /// asks for it ([`StepOptions::skip_overflow`]) skips, and deciding it is its one blocking
    /// read.
    pub skipped: bool,
    pub reduce: ReduceStats,
}

/// How gradients become a step: clipping bound, fp16 loss scale, and the parameters whose
/// gradients another rank of the replica puts into the norm.
#[derive(Debug, Clone, Copy)]
pub struct StepOptions<'a> {
    pub lr: f64,
    /// Global-norm bound; 0 measures the norm without clipping.
    pub max_norm: f64,
    /// The gradients are those of `loss_scale · L` (fp16's loss scaling, or a sum of several
    /// ranks' means; 1 otherwise).
    pub loss_scale: f64,
    /// Skip the step when some gradient overflowed (fp16's dynamic loss scaling). Deciding it
    /// reads the norm back: one blocking read per step. Otherwise the step never waits for the
    /// device, and a non-finite gradient goes into the update as it would in PyTorch; the norm
    /// shows it when it is read.
    pub skip_overflow: bool,
    /// Parameters left out of the norm: exact copies of a parameter another rank counts (a
    /// tied embedding's second copy, a parameter every tensor-parallel rank holds whole).
    pub counted_elsewhere: &'a [ParamId],
}

impl StepOptions<'_> {
    /// A step at `lr`, clipped to `max_norm`, without loss scaling.
    pub fn new(lr: f64, max_norm: f64) -> Self {
        Self {
            lr,
            max_norm,
            loss_scale: 1.0,
            skip_overflow: false,
            counted_elsewhere: &[],
        }
    }
}

/// The data-parallel update of a module `M` on autodiff backend `A`: DDP with any Burn
/// optimizer `O`, ZeRO 3 by units with it, or ZeRO 1–3's sharded AdamW.
pub enum Update<A: AutodiffBackend, O> {
    /// The Burn optimizer steps every parameter the model holds; `layout` gives the
    /// all-reduce's buckets. ZeRO 0: every replica holds everything. ZeRO 3 by units
    /// (`unit_rows` is the number of elements this rank holds of them): the parameters inside
    /// `ShardedUnit`s are this rank's rows, left out of `layout`; their gradients arrive
    /// reduce-scattered by the backward pass.
    Replicated {
        optimizer: Mutex<O>,
        layout: Mutex<FlatLayout>,
        unit_rows: Option<usize>,
    },
    /// ZeRO 1–3.
    Sharded(Mutex<ZeroOptimizer<A::InnerBackend>>),
}

impl<A: AutodiffBackend, O> std::fmt::Debug for Update<A, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Replicated { layout, .. } => f
                .debug_struct("Replicated")
                .field("buckets", &lock(layout).buckets.len())
                .finish(),
            Self::Sharded(zero) => f.debug_tuple("Sharded").field(&*lock(zero)).finish(),
        }
    }
}

/// The one device's gradients of this rank out of Burn's per-device gradients (data
/// parallelism runs one device per rank).
pub fn one_device_grads(grads: MultiGradientsParams) -> Result<GradientsParams, UpdateError> {
    let mut parts = grads.grads;
    let devices = parts.len();
    match (parts.pop(), devices) {
        (Some((grads, _)), 1) => Ok(grads),
        _ => Err(UpdateError::Devices(devices)),
    }
}

/// `mutex`'s value, also after a panic elsewhere poisoned it.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl<A: AutodiffBackend, O> Update<A, O> {
    /// DDP with `optimizer` over the buckets `layout`.
    pub fn replicated(optimizer: O, layout: FlatLayout) -> Self {
        Self::Replicated {
            optimizer: Mutex::new(optimizer),
            layout: Mutex::new(layout),
            unit_rows: None,
        }
    }

    /// ZeRO 3 by units with `optimizer`: `layout` holds the parameters outside the units, and
    /// this rank holds `unit_rows` elements of those inside.
    pub fn by_units(optimizer: O, layout: FlatLayout, unit_rows: usize) -> Self {
        Self::Replicated {
            optimizer: Mutex::new(optimizer),
            layout: Mutex::new(layout),
            unit_rows: Some(unit_rows),
        }
    }

    /// ZeRO 1–3 with `zero`.
    pub fn sharded(zero: ZeroOptimizer<A::InnerBackend>) -> Self {
        Self::Sharded(Mutex::new(zero))
    }

    /// The ZeRO stage.
    pub fn stage(&self) -> ZeroStage {
        match self {
            Self::Replicated {
                unit_rows: None, ..
            } => ZeroStage::Replicated,
            Self::Replicated { .. } => ZeroStage::ShardParameters,
            Self::Sharded(zero) => lock(zero).stage(),
        }
    }

    /// The sharded optimizer, where there is one.
    pub fn zero(&self) -> Option<MutexGuard<'_, ZeroOptimizer<A::InnerBackend>>> {
        match self {
            Self::Replicated { .. } => None,
            Self::Sharded(zero) => Some(lock(zero)),
        }
    }

    /// The replicated optimizer, where there is one.
    pub fn optimizer(&self) -> Option<MutexGuard<'_, O>> {
        match self {
            Self::Replicated { optimizer, .. } => Some(lock(optimizer)),
            Self::Sharded(_) => None,
        }
    }

    /// The parameters of `model` held by rows (inside `ShardedUnit`s, under ZeRO 3 by units);
    /// none otherwise.
    pub fn held_by_rows<M: AutodiffModule<A>>(&self, model: &M) -> HashSet<ParamId> {
        match self {
            Self::Replicated {
                unit_rows: Some(_), ..
            } => unit_params(model),
            _ => HashSet::new(),
        }
    }

    /// Bytes this rank holds for its model state (f32): with the Burn optimizer, the
    /// parameters it holds (ZeRO 0: all; by units: its rows of theirs), their gradients and two
    /// AdamW moments (what Burn's AdamW keeps; other optimizers differ).
    pub fn state_bytes(&self) -> StateBytes {
        match self {
            Self::Replicated {
                layout, unit_rows, ..
            } => {
                let bytes = 4 * (lock(layout).numel() + unit_rows.unwrap_or(0));
                StateBytes {
                    params: bytes,
                    grads: bytes,
                    optimizer_device: 2 * bytes,
                    optimizer_host: 0,
                }
            }
            Self::Sharded(zero) => lock(zero).state_bytes(),
        }
    }

    /// Reduces `grads` (this rank's, summed over its micro-batches; under ZeRO 3 already
    /// reduced to owned parts) over the data-parallel ranks, clips by the global norm, and
    /// returns the updated model. Nothing is read back from the device, except under
    /// [`StepOptions::skip_overflow`].
    ///
    /// Unscaling rides with the clipping: `g ← g · min(1, max_norm/‖g‖) / S` with
    /// `‖g‖ = ‖S·g‖ / S`, one factor computed on the device. When `‖S·g‖` is not finite, some
    /// gradient on some rank overflowed: every rank sees the same sum of squares, so with
    /// `skip_overflow` every rank returns the model unchanged (`skipped`). A gradient left out
    /// of the sum (`counted_elsewhere`) is an exact copy of one in it, so it cannot overflow
    /// alone.
    pub fn update<M>(
        &self,
        groups: UpdateGroups,
        model: M,
        grads: GradientsParams,
        options: StepOptions,
    ) -> Result<(M, UpdateStats<A::InnerBackend>), UpdateError>
    where
        M: AutodiffModule<A>,
        O: Optimizer<M, A>,
    {
        let StepOptions {
            lr,
            max_norm,
            loss_scale,
            skip_overflow,
            counted_elsewhere,
        } = options;
        match self {
            Self::Replicated {
                optimizer,
                layout,
                unit_rows,
            } => {
                let device = module_inner_device(&model);
                let (mut grads, reduce) =
                    dp::all_reduce_gradients(groups.data, &lock(layout), &model, grads, &device)?;
                let units = self.held_by_rows(&model);
                let counted = |id| !counted_elsewhere.contains(&id);
                let whole = grad_sum_of_squares_where(&model, &grads, |id| {
                    counted(id) && !units.contains(&id)
                });
                let mut squares = sum_over(groups.replica, whole)?;
                if unit_rows.is_some() {
                    // Each rank holds its own rows of the units' gradients.
                    let rows = grad_sum_of_squares_where(&model, &grads, |id| {
                        counted(id) && units.contains(&id)
                    });
                    squares = squares + sum_over(groups.world, rows)?;
                }
                let grad_norm = squares.sqrt() / loss_scale;
                if skip_overflow && !read_value(grad_norm.clone()).is_finite() {
                    return Ok((model, UpdateStats::skipped(grad_norm, reduce)));
                }
                if let Some(factor) = unscale_and_clip(grad_norm.clone(), max_norm, loss_scale) {
                    scale_grads(&model, &mut grads, factor);
                }
                let mut optimizer = lock(optimizer);
                let _lock = graphs_lock();
                let model = optimizer.step(lr, model, grads);
                Ok((model, UpdateStats::applied(grad_norm, reduce)))
            }
            Self::Sharded(zero) => {
                let mut zero = lock(zero);
                let (mut grads, reduce) = match zero.stage() {
                    ZeroStage::ShardParameters => (grads, ReduceStats::default()),
                    _ => zero.reduce(&model, grads)?,
                };
                let squares = zero.shard_sum_of_squares(&grads, counted_elsewhere);
                let grad_norm = sum_over(groups.world, squares)?.sqrt() / loss_scale;
                if skip_overflow && !read_value(grad_norm.clone()).is_finite() {
                    return Ok((model, UpdateStats::skipped(grad_norm, reduce)));
                }
                if let Some(factor) = unscale_and_clip(grad_norm.clone(), max_norm, loss_scale) {
                    zero.scale_shards(&mut grads, &factor);
                }
                let current = match zero.stage() {
                    ZeroStage::ShardParameters => Default::default(),
                    _ => dp::flat_params(&model),
                };
                let updated = zero.step(lr, &current, &mut grads)?;
                drop(current);
                let _lock = graphs_lock();
                let model = model.map(&mut SetParams(&updated));
                Ok((model, UpdateStats::applied(grad_norm, reduce)))
            }
        }
    }
}

impl<B: Backend> UpdateStats<B> {
    fn applied(grad_norm: Tensor<B, 1>, reduce: ReduceStats) -> Self {
        Self {
            grad_norm,
            skipped: false,
            reduce,
        }
    }

    fn skipped(grad_norm: Tensor<B, 1>, reduce: ReduceStats) -> Self {
        Self {
            grad_norm,
            skipped: true,
            reduce,
        }
    }
}

/// ZeRO 1–3's sharded AdamW for `model`, on its parameters' device: `halves` updates the
/// buckets of `layout` that hold matrices and vectors (they differ in weight decay), over the
/// data-parallel `group`; it takes the owned parts of the model's parameters where the stage
/// keeps its own copy (stage 3, offload).
pub fn zero_optimizer<A: AutodiffBackend, M: AutodiffModule<A>>(
    model: &M,
    stage: ZeroStage,
    group: ProcessGroup,
    layout: FlatLayout,
    halves: (FusedAdamW, FusedAdamW),
    offload: bool,
) -> ZeroOptimizer<A::InnerBackend> {
    let device = module_inner_device(model);
    let mut zero = ZeroOptimizer::new(stage, group, layout, halves, offload, device);
    zero.set_params(&dp::flat_params(model));
    zero
}
