//! From a rank's local gradients to updated parameters, under every data-parallel mode: the
//! reduction over the data-parallel ranks, the global gradient norm and clipping, and AdamW.
//!
//! ```text
//! ZeRO 0 (DDP)   all-reduce in buckets → full gradients on every replica → Burn's AdamW per tensor
//! ZeRO 1 / 2     all-reduce / reduce-scatter in buckets → owned parts → AdamW on the owned
//!                parts → all-gather the updated parameters
//! ZeRO 3         (the step reduce-scattered already) → AdamW on the owned parts, kept sharded
//! ```
//!
//! The norm is that of the full gradient in every mode: replicated gradients are summed over
//! the ranks of one model replica only (pipeline stages × tensor-parallel parts; each parameter
//! once: the tied embedding's copy left out, and a parameter every tensor-parallel rank holds
//! whole counted on the first of them); owned parts over every rank.

use std::sync::{Mutex, MutexGuard};

use anyhow::Context;
use burn::module::{Module, ParamId};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use wildfire_backend::comm::{HostTensor, ProcessGroup, ReduceOp};
use wildfire_parallel::dp::{self, FlatLayout, ParamSpec, ReduceStats, SetParams};
use wildfire_parallel::fsdp::{StateBytes, ZeroOptimizer, ZeroStage};
use wildfire_parallel::pp::graphs_lock;
use wildfire_parallel::precision::unscaled_norm;

use crate::checkpoint::ModelLayout;
use crate::model::{GptChunks, TIED_COPY};
use crate::optim::{GptOptimizer, clip_factor, grad_sum_of_squares_except, scale_grads};

/// The optimizer of a run, with its data-parallel reduction.
pub enum Optimizers<B: AutodiffBackend> {
    /// ZeRO 0: every replica holds everything.
    Replicated {
        optimizer: GptOptimizer<GptChunks<B>, B>,
        layout: FlatLayout,
    },
    /// ZeRO 1–3.
    Sharded(Mutex<ZeroOptimizer<B::InnerBackend>>),
}

impl<B: AutodiffBackend> std::fmt::Debug for Optimizers<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Replicated { layout, .. } => f
                .debug_struct("Replicated")
                .field("buckets", &layout.buckets.len())
                .finish(),
            Self::Sharded(zero) => f.debug_tuple("Sharded").field(&*lock(zero)).finish(),
        }
    }
}

/// `mutex`'s value, also after a panic elsewhere poisoned it.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// The groups an update communicates over.
#[derive(Debug)]
pub struct UpdateGroups<'a> {
    /// Every rank of the job.
    pub world: &'a ProcessGroup,
    /// The ranks that hold one model replica between them (pipeline × tensor-parallel).
    pub replica: &'a ProcessGroup,
    /// This rank's data-parallel group.
    pub data: &'a ProcessGroup,
}

/// What an update measured.
#[derive(Debug, Clone, Copy, Default)]
pub struct UpdateStats {
    /// The global norm of the (unscaled) gradients before clipping; `None` when some gradient
    /// overflowed, and the update was skipped.
    pub grad_norm: Option<f64>,
    pub reduce: ReduceStats,
}

impl UpdateStats {
    fn applied(grad_norm: f64, reduce: ReduceStats) -> Self {
        Self {
            grad_norm: Some(grad_norm),
            reduce,
        }
    }

    fn skipped(reduce: ReduceStats) -> Self {
        Self {
            grad_norm: None,
            reduce,
        }
    }
}

/// The factor that unscales gradients of `loss_scale · L` and clips them to `max_norm` (given
/// their true norm), or `None` when it is 1.
fn unscale_and_clip(grad_norm: f64, max_norm: f64, loss_scale: f64) -> Option<f64> {
    let factor = clip_factor(grad_norm, max_norm).unwrap_or(1.0) / loss_scale;
    (factor != 1.0).then_some(factor)
}

/// `value` summed over `group` (itself in a group of one).
pub(super) fn group_sum(group: &ProcessGroup, value: f64) -> anyhow::Result<f64> {
    if group.size() == 1 {
        return Ok(value);
    }
    let sum = group.all_reduce_host(HostTensor::new(vec![value], vec![1]), ReduceOp::Sum)?;
    Ok(sum.data[0])
}

/// The ZeRO layout of `model`'s parameters: one unit per chunk under stage 3 (each chunk is one
/// block there), the tied embedding alone in its bucket. Under stage 3 the head's copy of the
/// embedding is left out (it is gathered from the embedding, see `run_sharded_step`); a
/// pipeline's last stage keeps its copy, alone in its bucket too.
pub fn zero_layout<B: AutodiffBackend>(
    model: &GptChunks<B>,
    stage: ZeroStage,
    bucket_bytes: usize,
) -> FlatLayout {
    let (embedding, copy) = model.tied_embedding_ids();
    let units = stage == ZeroStage::Three;
    let specs: Vec<ParamSpec> = model
        .chunks
        .iter()
        .enumerate()
        .flat_map(|(index, chunk)| {
            dp::param_specs(chunk)
                .into_iter()
                .map(move |spec| ParamSpec {
                    unit: if units { index } else { 0 },
                    alone: [embedding, copy].contains(&Some(spec.id)),
                    ..spec
                })
        })
        .filter(|spec| !(units && Some(spec.id) == copy))
        .collect();
    FlatLayout::new(&specs, bucket_bytes)
}

impl<B: AutodiffBackend> Optimizers<B> {
    /// The ZeRO stage.
    pub fn stage(&self) -> ZeroStage {
        match self {
            Self::Replicated { .. } => ZeroStage::Zero0,
            Self::Sharded(zero) => lock(zero).stage(),
        }
    }

    /// The sharded optimizer, where there is one.
    pub fn sharded(&self) -> Option<MutexGuard<'_, ZeroOptimizer<B::InnerBackend>>> {
        match self {
            Self::Replicated { .. } => None,
            Self::Sharded(zero) => Some(lock(zero)),
        }
    }

    /// Bytes this rank holds for its model state (f32): for ZeRO 0 the whole chunks' parameters,
    /// gradients and two AdamW moments.
    pub fn state_bytes(&self) -> StateBytes {
        match self {
            Self::Replicated { layout, .. } => {
                let bytes = 4 * layout.numel();
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
    /// reduced to owned parts) over the data-parallel ranks, clips by the global norm with
    /// `max_norm`, and returns the updated model. `counted_elsewhere` are the parameters whose
    /// gradients another rank puts into the norm (see the module doc).
    ///
    /// The gradients are those of `loss_scale · L` (fp16's loss scaling; 1 otherwise): they are
    /// unscaled together with the clipping, `g ← g · min(1, max_norm/‖g‖) / S` with
    /// `‖g‖ = ‖S·g‖ / S`. When `‖S·g‖` is not finite, some gradient on some rank overflowed:
    /// every rank sees the same sum of squares, so every rank returns the model unchanged
    /// (`grad_norm: None`). A gradient left out of the sum (`counted_elsewhere`) is an exact
    /// copy of one in it, so it cannot overflow alone.
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &self,
        groups: &UpdateGroups,
        model: GptChunks<B>,
        grads: GradientsParams,
        lr: f64,
        max_norm: f64,
        counted_elsewhere: &[ParamId],
        loss_scale: f64,
    ) -> anyhow::Result<(GptChunks<B>, UpdateStats)> {
        let device = inner_device(&model);
        match self {
            Self::Replicated { optimizer, layout } => {
                let (mut grads, reduce) =
                    dp::all_reduce_gradients(groups.data, layout, &model, grads, &device)?;
                let squares = grad_sum_of_squares_except(&model, &grads, counted_elsewhere);
                let scaled_norm = group_sum(groups.replica, squares)?.sqrt();
                let Some(grad_norm) = unscaled_norm(scaled_norm, loss_scale) else {
                    return Ok((model, UpdateStats::skipped(reduce)));
                };
                if let Some(factor) = unscale_and_clip(grad_norm, max_norm, loss_scale) {
                    scale_grads(&model, &mut grads, factor);
                }
                let _lock = graphs_lock();
                let model = optimizer.clone().step(lr, model, grads);
                Ok((model, UpdateStats::applied(grad_norm, reduce)))
            }
            Self::Sharded(zero) => {
                let mut zero = lock(zero);
                let (mut grads, reduce) = match zero.stage() {
                    ZeroStage::Three => (grads, ReduceStats::default()),
                    _ => zero.reduce(&model, grads)?,
                };
                let squares = zero.shard_sum_of_squares(&grads, counted_elsewhere);
                let scaled_norm = group_sum(groups.world, squares)?.sqrt();
                let Some(grad_norm) = unscaled_norm(scaled_norm, loss_scale) else {
                    return Ok((model, UpdateStats::skipped(reduce)));
                };
                if let Some(factor) = unscale_and_clip(grad_norm, max_norm, loss_scale) {
                    zero.scale_shards(&mut grads, factor);
                }
                let current = match zero.stage() {
                    ZeroStage::Three => Default::default(),
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

/// The parameters of `model` whose gradients another rank of its replica puts into the norm:
/// the head's copy of the tied embedding (the embedding's is counted), and, on every
/// tensor-parallel rank but the first, the parameters all of them hold whole.
pub fn counted_elsewhere<B: AutodiffBackend>(
    model: &GptChunks<B>,
    layout: &ModelLayout,
) -> Vec<ParamId> {
    let plan = &layout.plan;
    model
        .param_ids_where(|name, dims| {
            name == TIED_COPY || (plan.rank > 0 && !plan.is_split(name, dims))
        })
        .into_iter()
        .map(|(id, _)| id)
        .collect()
}

/// The inner backend's device of `model`'s parameters.
pub fn inner_device<B: AutodiffBackend>(
    model: &GptChunks<B>,
) -> burn::tensor::Device<B::InnerBackend> {
    device_inner::<B>(&model.devices().into_iter().next().unwrap_or_default())
}

/// The inner backend's device that corresponds to `device`.
pub fn device_inner<B: AutodiffBackend>(
    device: &B::Device,
) -> burn::tensor::Device<B::InnerBackend> {
    burn::tensor::Tensor::<B, 1>::zeros([1], device)
        .inner()
        .device()
}

/// Checks that every data-parallel replica starts from the same parameters: an FNV-1a hash of
/// every parameter's bits, in registration order, compared over `data`.
pub fn check_same_init<B: AutodiffBackend>(
    model: &GptChunks<B>,
    data: &ProcessGroup,
) -> anyhow::Result<()> {
    if data.size() == 1 {
        return Ok(());
    }
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut values = dp::flat_params(model);
    for spec in dp::param_specs(model) {
        let Some(value) = values.remove(&spec.id) else {
            continue;
        };
        let data = value.into_data();
        for byte in data.as_bytes() {
            hash = (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    // Two halves, each exact in f64.
    let mine = HostTensor::new(
        vec![(hash >> 32) as f64, (hash & 0xffff_ffff) as f64],
        vec![1, 2],
    );
    let all = data
        .all_gather_host(mine, 0)
        .context("comparing initial parameters")?;
    let hashes: Vec<u64> = all
        .data
        .chunks(2)
        .map(|pair| ((pair[0] as u64) << 32) | pair[1] as u64)
        .collect();
    if let Some(rank) = hashes.iter().position(|h| *h != hashes[0]) {
        anyhow::bail!(
            "data-parallel rank {rank} starts from different parameters than rank 0 (checksums \
             {:016x} and {:016x}): every replica must draw the same initialisation",
            hashes[rank],
            hashes[0]
        );
    }
    Ok(())
}
