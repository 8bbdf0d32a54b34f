//! The MLP classifier of [`crate::mlp`] under tensor parallelism: its plan is a few lines of
//! data, and one call splits the model by it. The two hidden blocks form a Megatron pair, the
//! first column-parallel (each rank computes its columns of the hidden units), the second
//! row-parallel (each rank multiplies its columns by its rows; the ranks' sums are added), so
//! a step communicates once forward and once backward. With sequence parallelism the ReLU after
//! the pair runs on this rank's part of the batch's points (the dimension the plan names), the
//! pair's all-reduce becoming an all-gather before it and a reduce-scatter after it.
//!
//! The training loop is Burn's own (forward, backward, `GradientsParams`, an optimizer step);
//! what tensor parallelism adds is [`apply_plan`] once, and under sequence parallelism the sum
//! of the gradients that each rank computes over its points only ([`SequencePartial`]: here the
//! row-parallel block's bias). Its checkpoints ([`crate::checkpoints`]) hold whole tensors cut
//! into the ranks' boxes, so a run saved at one degree resumes at another, or cut into pipeline
//! stages ([`crate::pipeline`]).

use burn::module::AutodiffModule;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::ElementConversion;
use burn::tensor::backend::AutodiffBackend;
use wildfire_backend::collective::CollectiveBackend;
use wildfire_backend::comm::ProcessGroup;
use wildfire_parallel::checkpoint::module::ModuleLayout;
use wildfire_parallel::grad_sum::GradSumError;
use wildfire_parallel::pp::graphs_lock;
use wildfire_parallel::tp::{PlanError, SequencePartial, TpPlan, TpStyle, apply_plan};

use crate::checkpoints;
use crate::mlp::{LoopRun, Mlp, Points, StepLog};

/// The MLP's tensor-parallel plan: the first two hidden blocks as a column-, row-parallel pair
/// (further blocks stay whole on every rank, as do the input and output layers).
pub const TP_PLAN: &[(&str, TpStyle)] = &[
    ("blocks.0.module.linear", TpStyle::COLUMN),
    ("blocks.1.module.linear", TpStyle::Row),
];

/// The dimension sequence parallelism splits: the points of a batch `[points, width]`.
pub const SEQUENCE_DIM: usize = 0;

/// This rank's plan over `group`, with or without sequence parallelism.
pub fn plan(group: &ProcessGroup, sequence_parallel: bool) -> TpPlan {
    let sequence_dim = sequence_parallel.then_some(SEQUENCE_DIM);
    TpPlan::new(TP_PLAN, group.rank(), group.size()).with_sequence_parallel(sequence_dim)
}

/// The model of `run`, drawn whole from its seed and split by its plan over `group` (a group of
/// one rank keeps it whole), with its layout (where this rank's part sits in the whole model).
pub fn build<B>(
    run: &LoopRun,
    sequence_parallel: bool,
    group: &ProcessGroup,
) -> Result<(Mlp<B>, ModuleLayout), PlanError>
where
    B: AutodiffBackend + CollectiveBackend,
{
    let device = B::Device::default();
    let plan = plan(group, sequence_parallel);
    // Ranks that are threads of one process share Burn's RNG and autodiff registry.
    let _lock = graphs_lock();
    let model = Mlp::<B>::drawn(&device, run.shape, run.seed, StepLog::default());
    let layout = ModuleLayout::of(&model, plan.clone());
    Ok((apply_plan(model, &plan, group)?, layout))
}

/// The batch's mean cross-entropy loss.
pub fn loss<B>(model: &Mlp<B>, batch: Points<B>) -> burn::tensor::Tensor<B, 1>
where
    B: AutodiffBackend + CollectiveBackend,
{
    let logits = model.forward(batch.inputs);
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, batch.targets)
}

/// The gradients of `model` on `batch`, each rank's whole where the plan sums them over the
/// group (the sequence-partial ones), with the batch's loss.
pub fn gradients<B>(
    model: &Mlp<B>,
    batch: Points<B>,
    partial: &SequencePartial,
    group: &ProcessGroup,
) -> Result<(GradientsParams, f32), GradSumError>
where
    B: AutodiffBackend + CollectiveBackend,
{
    let loss = loss(model, batch);
    let value = loss.clone().into_scalar().elem::<f32>();
    let mut grads = GradientsParams::from_grads(loss.backward(), model);
    partial.sum::<B::InnerBackend>(&mut grads, group)?;
    Ok((grads, value))
}

/// Trains `run` on this rank of `group` with Burn's AdamW, from the newest checkpoint of the run
/// if it has one: returns the trained model (this rank's part of it) and the loss of every step
/// it took (the same on every rank).
pub fn train<B>(
    run: &LoopRun,
    sequence_parallel: bool,
    group: &ProcessGroup,
) -> anyhow::Result<(Mlp<B>, Vec<f32>)>
where
    B: AutodiffBackend + CollectiveBackend,
    Mlp<B>: AutodiffModule<B>,
{
    let (model, layout) = build::<B>(run, sequence_parallel, group)?;
    let partial = SequencePartial::of(&model, &layout.plan);
    let (mut model, mut optimizer, start) = checkpoints::resume(
        run.checkpoints.as_ref(),
        &layout,
        model,
        AdamWConfig::new().init(),
    )?;
    let mut losses = Vec::with_capacity(run.steps);
    for step in start..run.steps {
        let (grads, loss) = gradients(&model, run.batch(step), &partial, group)?;
        losses.push(loss);
        {
            // The step makes new parameter leaves: thread ranks take the autodiff lock for it.
            let _lock = graphs_lock();
            model = optimizer.step(run.lr, model, grads);
        }
        checkpoints::save_when_due(
            run.checkpoints.as_ref(),
            step + 1,
            &layout,
            &model,
            &optimizer,
            group,
        )?;
    }
    Ok((model, losses))
}
