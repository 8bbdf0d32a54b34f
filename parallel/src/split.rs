//! One rank's forward and backward passes of a training step, whatever splits its model
//! replica over ranks, for any module cut into [`PipelineChunk`]s:
//!
//! ```text
//! pipeline (pp ≥ 1)   run the checked schedule over the rank's chunks and the micro-batches
//!                     (one stage on one rank: forward, backward, per micro-batch)
//!                     → Σ_mb ∇ per chunk, summed over the chunks
//!                     → tied copies (first and last stage) both get ∇_first + ∇_second
//! tensor parallel     → sequence-partial parameters get Σ over the tensor-parallel group
//! ZeRO 3              each unit gathered for its forward and backward, its gradients
//!                     reduce-scattered (see `fsdp::run_sharded_step`) → this rank's parts
//! ```
//!
//! The gradients then go to the data-parallel update ([`crate::update`]).

use std::time::{Duration, Instant};

use burn::module::{AutodiffModule, Module};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use wildfire_backend::comm::{CommError, ProcessGroup};

use crate::device_value::sum_over;
use crate::fsdp::{ZeroError, ZeroOptimizer, ZeroStage, run_sharded_forward, run_sharded_step};
use crate::grad_sum::GradSumError;
use crate::mesh::{Mesh, MeshError, PipelinePlan};
use crate::pp::{PipelineChunk, PipelineError, StepStats, TiedCopies, run_forward, run_step};
use crate::tp::SequencePartial;

/// Why a rank's forward or backward passes failed.
#[derive(Debug, thiserror::Error)]
pub enum SplitError {
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error(transparent)]
    Zero(#[from] ZeroError),
    #[error(transparent)]
    GradSum(#[from] GradSumError),
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// How one model replica is split over ranks, as this rank sees it.
#[derive(Debug)]
pub struct ModelSplit {
    /// The checked pipeline (one stage when there is none).
    pub plan: PipelinePlan,
    /// The pipeline group (group rank = pipeline rank).
    pub pipe: ProcessGroup,
    /// The tensor-parallel group.
    pub tensor: ProcessGroup,
    /// The copies of a tied matrix (an embedding and the head that multiplies by it) this rank
    /// holds.
    pub tied: TiedCopies,
    /// The group of the two stages that hold the tied copies, when those differ and this rank
    /// is one of them.
    pub tie_group: Option<ProcessGroup>,
    /// Under sequence parallelism, the parameters whose gradients cover this rank's part of the
    /// sequence only; none otherwise.
    pub sequence_partial: SequencePartial,
}

/// This rank's gradients of one step and what computing them measured; `B` is the backend the
/// gradients live on (an autodiff backend's inner one).
#[derive(Debug)]
pub struct StepGradients<B: Backend> {
    /// Summed over the micro-batches (under ZeRO 3 already reduced to this rank's parts).
    pub grads: GradientsParams,
    /// The summed reported loss of the micro-batches on the last pipeline stage (0 elsewhere),
    /// on the device: see [`ModelSplit::world_loss`].
    pub loss: Tensor<B, 1>,
    pub stats: StepStats,
    /// Time in ZeRO 3's gathers and reduce-scatters (zero otherwise).
    pub unit_comm: Duration,
}

impl ModelSplit {
    /// This rank's split of `mesh`'s replica along the checked pipeline `plan`: `tied` is the
    /// copies of a matrix the model ties between its ends (`None` when it ties none), and
    /// `sequence_partial` the parameters sequence parallelism leaves partial.
    pub fn new(
        mesh: &Mesh,
        plan: PipelinePlan,
        tied: Option<TiedCopies>,
        sequence_partial: SequencePartial,
    ) -> Result<Self, MeshError> {
        let tie_group = match tied {
            Some(_) => mesh.tie_group()?,
            None => None,
        };
        Ok(Self {
            plan,
            pipe: mesh.pipeline().clone(),
            tensor: mesh.tensor().clone(),
            tied: tied.unwrap_or_default(),
            tie_group,
            sequence_partial,
        })
    }

    /// This rank's gradients of the step over `micro` (see the module doc). `chunks` are the
    /// rank's pipeline chunks, or under ZeRO 3 (`zero` of stage 3) its units, in order.
    pub fn gradients<A, C>(
        &self,
        chunks: &[C],
        micro: &[C::Batch],
        zero: Option<&ZeroOptimizer<A::InnerBackend>>,
        device: &A::Device,
    ) -> Result<StepGradients<A::InnerBackend>, SplitError>
    where
        A: AutodiffBackend,
        C: PipelineChunk<A> + AutodiffModule<A>,
    {
        if let Some(zero) = sharded_units(zero) {
            let started = Instant::now();
            let step = run_sharded_step(zero, chunks, micro, self.tied.both())?;
            let stats = StepStats {
                busy: started.elapsed().saturating_sub(step.comm),
                wall: started.elapsed(),
                peak_activations: micro.len(),
            };
            return Ok(StepGradients {
                grads: step.grads,
                loss: step.loss,
                stats,
                unit_comm: step.comm,
            });
        }
        let schedule = &self.plan.schedule;
        let rank = self.pipe.rank();
        let result = run_step(schedule, rank, &self.pipe, chunks, micro, device)?;
        let mut accumulator = GradientsAccumulator::new();
        for (chunk, grads) in chunks.iter().zip(result.grads) {
            accumulator.accumulate(chunk, grads);
        }
        let mut grads = accumulator.grads();
        // A tied copy is a matrix: rank 2.
        (self.tied).sum::<A::InnerBackend, 2>(&mut grads, self.tie_group.as_ref())?;
        (self.sequence_partial).sum::<A::InnerBackend>(&mut grads, &self.tensor)?;
        Ok(StepGradients {
            grads,
            loss: result.loss,
            stats: result.stats,
            unit_comm: Duration::ZERO,
        })
    }

    /// The summed loss of `batches` through the replica, forward only (evaluation), known on
    /// every rank of the pipeline: through the pipeline's stages, or under ZeRO 3 (`zero` of
    /// stage 3) through the gathered units, whose forward takes the batches on the autodiff
    /// backend, as `lift` makes them (no gradient is taken). The loss stays on the device.
    pub fn forward_loss<A, C>(
        &self,
        chunks: &[C],
        batches: Vec<<C::InnerModule as PipelineChunk<A::InnerBackend>>::Batch>,
        zero: Option<&ZeroOptimizer<A::InnerBackend>>,
        lift: impl Fn(<C::InnerModule as PipelineChunk<A::InnerBackend>>::Batch) -> C::Batch,
    ) -> Result<Tensor<A::InnerBackend, 1>, SplitError>
    where
        A: AutodiffBackend,
        C: PipelineChunk<A> + AutodiffModule<A>,
        C::InnerModule: PipelineChunk<A::InnerBackend>,
    {
        let loss = match sharded_units(zero) {
            Some(zero) => {
                let batches: Vec<C::Batch> = batches.into_iter().map(lift).collect();
                run_sharded_forward(zero, chunks, &batches, self.tied.both())?
            }
            None => {
                let chunks: Vec<C::InnerModule> = chunks.iter().map(|c| c.valid()).collect();
                let device = (chunks.first())
                    .and_then(|c| c.devices().into_iter().next())
                    .unwrap_or_default();
                let stages = self.plan.schedule.stages;
                let rank = self.pipe.rank();
                run_forward(stages, rank, &self.pipe, &chunks, &batches, &device)?
            }
        };
        Ok(sum_over(&self.pipe, loss)?)
    }

    /// The sum over `world` of every replica's step loss `loss` (as the last pipeline stage
    /// reports it, 0 elsewhere), each replica counted once: its tensor-parallel ranks all
    /// computed it. On the device; a collective, not a read.
    pub fn world_loss<B: Backend>(
        &self,
        world: &ProcessGroup,
        loss: Tensor<B, 1>,
    ) -> Result<Tensor<B, 1>, CommError> {
        let counted = match self.tensor.rank() {
            0 => loss,
            _ => loss.zeros_like(),
        };
        sum_over(world, counted)
    }
}

/// `zero` when it runs ZeRO 3, whose units the passes gather.
fn sharded_units<B: Backend>(zero: Option<&ZeroOptimizer<B>>) -> Option<&ZeroOptimizer<B>> {
    zero.filter(|z| z.stage() == ZeroStage::ShardParameters)
}
