//! ZeRO stages 1–3 (stage 3 is FSDP) and optimizer-state offload, over the flat buckets of
//! [`crate::dp`].
//!
//! Every bucket of `n` elements is split evenly over the `p` data-parallel ranks: rank `r` owns
//! elements `split_ranges(n, p)[r]` (the first `n mod p` ranks own one more, so no padding is
//! needed and sizes such as 7×15 = 105 over 2 ranks work). What each stage shards:
//!
//! | stage | parameters | gradients | AdamW moments | reduction |
//! |---|---|---|---|---|
//! | 0 (DDP) | replicated | replicated | replicated | all-reduce |
//! | 1 | replicated | replicated | owned part | all-reduce, then keep the owned part |
//! | 2 | replicated | owned part | owned part | reduce-scatter |
//! | 3 | owned part | owned part | owned part | reduce-scatter; all-gather per unit |
//!
//! Stages 1 and 2 update the owned part (`θ_r ← AdamW(θ_r, g_r)`) and all-gather the updated
//! parts into every replica. Stage 3 keeps only the owned part of every parameter between
//! steps: [`run_sharded_step`] all-gathers one unit's parameters just before that unit's
//! forward, frees them after it, all-gathers them again for the unit's backward (which
//! recomputes the unit's forward from its saved input) and reduce-scatters the unit's gradients
//! right after.
//!
//! The update is AdamW ([`FusedAdamW`], bit for bit Burn's) applied to the flat owned part, so
//! it is elementwise the same arithmetic as per-tensor AdamW: a sharded step equals a replicated
//! one bitwise when the gradients are equal. A bucket holds matrices or vectors only, so one weight decay applies.
//!
//! Two ways to run stage 3: [`run_sharded_step`] drives a model cut into pipeline-style units
//! itself (the recipe's GPT), and [`ShardedUnit`] lets a model run by Burn's own training loop
//! gather its parts in their forward (burn-train's `DataParallel` strategy); there the model
//! holds its rows and a Burn optimizer steps them.
//!
//! **Offload** keeps the owned master parameters and moments in host memory (Burn's `Flex`
//! backend) and runs the update there, as DeepSpeed's ZeRO-Offload does: on a GPU this frees
//! the moments' `8 bytes / p` per parameter of device memory (and under stage 3 the owned
//! parameters' `4 / p` too; stages 1 and 2 keep their replicated parameters on the device); on
//! the CPU the same code runs with both sides in host memory.

use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

use burn::backend::Flex;
use burn::module::{AutodiffModule, ParamId};
use burn::optim::{AdamWState, GradientsParams, SimpleOptimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use wildfire_backend::comm::{CommError, ProcessGroup, ReduceOp, split_ranges};
use wildfire_backend::host_data::aligned;
use wildfire_backend::kernels::adamw::FusedAdamW;

use crate::clip::scaled_by;
use crate::device_value::fold_sum;
use crate::dp::{self, FlatLayout, FlatTensors, ReduceStats};

mod sharded_unit;
mod state;
mod units;

pub use sharded_unit::{
    GatherScope, ShardError, ShardedUnit, gather_units, gather_units_within,
    reduce_scatter_unit_grads, shard_units, unit_params,
};
pub use state::{FullMoments, Piece, StateBytes};
pub use units::{Placeholders, ShardedStep, run_sharded_forward, run_sharded_step};

/// What is sharded over the data-parallel ranks (see the module table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum ZeroStage {
    /// ZeRO 0 (DDP): every rank holds everything.
    #[default]
    Replicated,
    /// ZeRO 1: each rank holds its shard of the optimizer state.
    ShardOptimizer,
    /// ZeRO 2: and of the gradients (reduce-scattered, not all-reduced).
    ShardGradients,
    /// ZeRO 3: and of the parameters (each unit gathered when it computes).
    ShardParameters,
}

impl ZeroStage {
    /// The stage numbered `level` (0–3).
    pub fn from_level(level: u8) -> Option<Self> {
        [
            Self::Replicated,
            Self::ShardOptimizer,
            Self::ShardGradients,
            Self::ShardParameters,
        ]
        .get(usize::from(level))
        .copied()
    }

    pub fn level(self) -> u8 {
        self as u8
    }
}

impl std::fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ZeRO-{}", self.level())
    }
}

/// A flat tensor on the device or in host memory.
#[derive(Debug, Clone)]
enum Flat<B: Backend> {
    Device(Tensor<B, 1>),
    Host(Tensor<Flex, 1>),
}

#[derive(Clone)]
enum Moments<B: Backend> {
    Device(AdamWState<B, 1>),
    Host(Box<AdamWState<Flex, 1>>),
}

/// One rank's part of one bucket.
#[derive(Clone)]
struct Shard<B: Backend> {
    range: Range<usize>,
    /// The owned parameters: the only copy under stage 3, the host master under offload.
    master: Option<Flat<B>>,
    moments: Option<Moments<B>>,
}

/// Why a sharded step failed.
#[derive(Debug, thiserror::Error)]
pub enum ZeroError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error("{0}")]
    State(String),
}

/// The sharded optimizer of ZeRO stages 1–3 on the (non-autodiff) backend `B`.
pub struct ZeroOptimizer<B: Backend> {
    stage: ZeroStage,
    group: ProcessGroup,
    layout: FlatLayout,
    matrices: FusedAdamW,
    vectors: FusedAdamW,
    offload: bool,
    shards: Vec<Shard<B>>,
    device: B::Device,
}

impl<B: Backend> std::fmt::Debug for ZeroOptimizer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroOptimizer")
            .field("stage", &self.stage)
            .field("group", &self.group.describe())
            .field("buckets", &self.layout.buckets.len())
            .field("offload", &self.offload)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> ZeroOptimizer<B> {
    /// `matrices` updates buckets of matrices, `vectors` the others (they differ in weight
    /// decay). `group` is the data-parallel group.
    pub fn new(
        stage: ZeroStage,
        group: ProcessGroup,
        layout: FlatLayout,
        (matrices, vectors): (FusedAdamW, FusedAdamW),
        offload: bool,
        device: B::Device,
    ) -> Self {
        let shards = layout
            .buckets
            .iter()
            .map(|bucket| Shard {
                range: match stage {
                    ZeroStage::Replicated => 0..bucket.numel,
                    _ => split_ranges(bucket.numel, group.size())[group.rank()].clone(),
                },
                master: None,
                moments: None,
            })
            .collect();
        Self {
            stage,
            group,
            layout,
            matrices,
            vectors,
            offload,
            shards,
            device,
        }
    }

    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// The device of the owned parts (and of the moments, unless offloaded).
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Follows the parameters to new ids (a module whose record was loaded takes the record's
    /// ids), matched by registration order and shape; see [`FlatLayout::rebind`].
    pub fn rebind(&mut self, params: &[dp::ParamSpec]) -> Result<(), ZeroError> {
        self.layout.rebind(params).map_err(ZeroError::State)
    }

    /// Whether this optimizer keeps its own copy of the owned parameters.
    fn keeps_master(&self) -> bool {
        self.stage == ZeroStage::ShardParameters || self.offload
    }

    /// Takes the owned parts of `params` (flat, by id) as the master copy where this stage
    /// keeps one (stage 3, offload). Call once at start and after loading a checkpoint.
    pub fn set_params(&mut self, params: &FlatTensors<B>) {
        if !self.keeps_master() {
            return;
        }
        for (bucket, shard) in self.layout.buckets.iter().zip(&mut self.shards) {
            let whole = dp::flatten(bucket, params, &self.device);
            shard.master = Some(place(owned_part(&whole, &shard.range), self.offload));
        }
    }

    /// Sums the local gradients of `module` over the data-parallel ranks as this stage does,
    /// and returns this rank's part of each bucket, registered under the bucket's id: stage 0
    /// all-reduces and keeps everything, stage 1 all-reduces and keeps its part, stage 2
    /// reduce-scatters. (DDP with Burn's own optimizer uses [`dp::all_reduce_gradients`].)
    pub fn reduce<A, M>(
        &self,
        module: &M,
        grads: GradientsParams,
    ) -> Result<(GradientsParams, ReduceStats), ZeroError>
    where
        A: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<A>,
    {
        let started = Instant::now();
        let mut grads = grads;
        let mut flat = dp::take_grads(module, &mut grads);
        let mut stats = ReduceStats::default();
        let mut sharded = GradientsParams::new();
        for (index, bucket) in self.layout.buckets.iter().enumerate() {
            let local = dp::flatten(bucket, &flat, &self.device);
            for slot in &bucket.slots {
                flat.remove(&slot.param.id);
            }
            let comm = Instant::now();
            let owned = self.reduce_bucket(index, local)?;
            stats.comm += comm.elapsed();
            stats.buckets += 1;
            stats.elements += bucket.numel;
            sharded.register(bucket.id, owned);
        }
        stats.total = started.elapsed();
        Ok((sharded, stats))
    }

    /// This rank's part of the sum over ranks of bucket `index`'s flat tensor `local`.
    fn reduce_bucket(&self, index: usize, local: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        if self.group.size() == 1 {
            return Ok(local);
        }
        match self.stage {
            ZeroStage::Replicated | ZeroStage::ShardOptimizer => Ok(owned_part(
                &self.group.all_reduce(local, ReduceOp::Sum)?,
                &self.shards[index].range,
            )),
            ZeroStage::ShardGradients | ZeroStage::ShardParameters => {
                self.group.reduce_scatter(local, 0, ReduceOp::Sum)
            }
        }
    }

    /// `Σ ‖g‖²` over this rank's parts of the sharded gradients `grads`, leaving out the
    /// parameters `skip`, on the device: one term per owned slot, folded in bucket and slot
    /// order in the device's widest float (see [`crate::clip`]). Under stages 1–3, summed over
    /// the data-parallel ranks it is the full gradient's (under stage 0 every rank owns
    /// everything: it is already the full one).
    pub fn shard_sum_of_squares(&self, grads: &GradientsParams, skip: &[ParamId]) -> Tensor<B, 1> {
        let mut terms = Vec::new();
        for (bucket, shard) in self.layout.buckets.iter().zip(&self.shards) {
            let Some(grad) = grads.get::<B, 1>(bucket.id) else {
                continue;
            };
            for slot in &bucket.slots {
                if skip.contains(&slot.param.id) {
                    continue;
                }
                let owned = intersect(&slot.range(), &shard.range);
                if owned.is_empty() {
                    continue;
                }
                let local = owned.start - shard.range.start..owned.end - shard.range.start;
                terms.push(grad.clone().slice(local).square().sum());
            }
        }
        fold_sum(terms, &self.device)
    }

    /// Multiplies every sharded gradient in `grads` by `factor`, a one-element tensor on the
    /// device (clipping and unscaling).
    pub fn scale_shards(&self, grads: &mut GradientsParams, factor: &Tensor<B, 1>) {
        for bucket in &self.layout.buckets {
            if let Some(grad) = grads.remove::<B, 1>(bucket.id) {
                grads.register(bucket.id, scaled_by(grad, factor));
            }
        }
    }

    /// AdamW at learning rate `lr` on the owned part of every bucket whose sharded gradient is
    /// in `grads`. `params` are the current parameters (flat, by id; unused where this
    /// optimizer keeps a master). Stages 0–2 return every updated parameter (flat; stages 1
    /// and 2 all-gather the parts); stage 3 keeps its parts and returns nothing.
    pub fn step(
        &mut self,
        lr: f64,
        params: &FlatTensors<B>,
        grads: &mut GradientsParams,
    ) -> Result<FlatTensors<B>, ZeroError> {
        let mut updated = HashMap::new();
        let keeps_master = self.keeps_master();
        for index in 0..self.layout.buckets.len() {
            let bucket = &self.layout.buckets[index];
            let Some(grad) = grads.remove::<B, 1>(bucket.id) else {
                continue;
            };
            let adam = if bucket.matrices {
                &self.matrices
            } else {
                &self.vectors
            };
            let shard = &mut self.shards[index];
            let current = match shard.master.take() {
                Some(master) => master,
                None => place(
                    dp::flatten(bucket, params, &self.device).slice(shard.range.clone()),
                    self.offload,
                ),
            };
            let (owned, moments) = update(adam, lr, current, grad, shard.moments.take())?;
            shard.moments = Some(moments);
            let on_device = match &owned {
                Flat::Device(t) => t.clone(),
                Flat::Host(t) => from_host(t.clone(), &self.device),
            };
            if keeps_master {
                shard.master = Some(owned);
            }
            match self.stage {
                ZeroStage::Replicated => updated.extend(dp::unflatten(bucket, on_device)),
                ZeroStage::ShardOptimizer | ZeroStage::ShardGradients => {
                    updated.extend(dp::unflatten(bucket, self.all_gather(on_device)?));
                }
                ZeroStage::ShardParameters => {}
            }
        }
        Ok(updated)
    }

    fn all_gather(&self, owned: Tensor<B, 1>) -> Result<Tensor<B, 1>, CommError> {
        if self.group.size() == 1 {
            return Ok(owned);
        }
        self.group.all_gather(owned, 0)
    }

    /// Stage 3: every parameter of `unit`, all-gathered from the owned parts (flat, by id).
    pub fn gather_unit(&self, unit: usize) -> Result<FlatTensors<B>, ZeroError> {
        self.gather_buckets(|bucket| bucket.unit == unit)
    }

    /// Stage 3: the buckets `pick` selects, all-gathered (flat, by parameter id).
    fn gather_buckets(
        &self,
        pick: impl Fn(&dp::Bucket) -> bool,
    ) -> Result<FlatTensors<B>, ZeroError> {
        let mut params = HashMap::new();
        for (bucket, shard) in self.layout.buckets.iter().zip(&self.shards) {
            if !pick(bucket) {
                continue;
            }
            let owned = match &shard.master {
                Some(Flat::Device(t)) => t.clone(),
                Some(Flat::Host(t)) => from_host(t.clone(), &self.device),
                None => {
                    return Err(ZeroError::State(format!(
                        "{} keeps no parameters of a bucket of {} elements: set_params was not \
                         called",
                        self.stage, bucket.numel
                    )));
                }
            };
            params.extend(dp::unflatten(bucket, self.all_gather(owned)?));
        }
        Ok(params)
    }
}

/// Elements `range` of `whole` in a buffer of their own. A slice may be a view that keeps its
/// whole source alive, which an owned part must not; multiplying by one copies it (exactly),
/// and `whole` being borrowed keeps a backend from doing that in place.
fn owned_part<B: Backend>(whole: &Tensor<B, 1>, range: &Range<usize>) -> Tensor<B, 1> {
    whole.clone().slice(range.clone()).mul_scalar(1.0)
}

fn intersect(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    a.start.max(b.start)..a.end.min(b.end).max(a.start.max(b.start))
}

fn to_host<B: Backend>(tensor: Tensor<B, 1>) -> Tensor<Flex, 1> {
    Tensor::from_data(aligned(tensor.into_data()), &Default::default())
}

fn from_host<B: Backend>(tensor: Tensor<Flex, 1>, device: &B::Device) -> Tensor<B, 1> {
    Tensor::from_data(tensor.into_data(), device)
}

fn place<B: Backend>(tensor: Tensor<B, 1>, host: bool) -> Flat<B> {
    if host {
        Flat::Host(to_host(tensor))
    } else {
        Flat::Device(tensor)
    }
}

/// One AdamW update of an owned part, where it lives: on the device, or in host memory (the
/// gradient is copied there).
fn update<B: Backend>(
    adam: &FusedAdamW,
    lr: f64,
    current: Flat<B>,
    grad: Tensor<B, 1>,
    moments: Option<Moments<B>>,
) -> Result<(Flat<B>, Moments<B>), ZeroError> {
    let mixed =
        || ZeroError::State("parameters and AdamW moments are in different memories".into());
    match current {
        Flat::Device(param) => {
            let state = match moments {
                Some(Moments::Device(state)) => Some(state),
                None => None,
                Some(Moments::Host(_)) => return Err(mixed()),
            };
            let (param, state) = adam_step(adam, lr, param, grad, state)?;
            Ok((Flat::Device(param), Moments::Device(state)))
        }
        Flat::Host(param) => {
            let state = match moments {
                Some(Moments::Host(state)) => Some(*state),
                None => None,
                Some(Moments::Device(_)) => return Err(mixed()),
            };
            let (param, state) = adam_step(adam, lr, param, to_host(grad), state)?;
            Ok((Flat::Host(param), Moments::Host(Box::new(state))))
        }
    }
}

fn adam_step<H: Backend>(
    adam: &FusedAdamW,
    lr: f64,
    param: Tensor<H, 1>,
    grad: Tensor<H, 1>,
    state: Option<AdamWState<H, 1>>,
) -> Result<(Tensor<H, 1>, AdamWState<H, 1>), ZeroError> {
    let (param, state) = SimpleOptimizer::<H>::step(adam, lr, param, grad, state);
    let state = state.ok_or_else(|| ZeroError::State("AdamW returned no state".into()))?;
    Ok((param, state))
}
