//! The MLP classifier of [`crate::mlp`] cut into pipeline stages: stage 0 holds the input layer
//! and the first hidden blocks, the last stage the remaining blocks and the output layer. What
//! the user writes is the cut ([`stages`]) and the [`PipelineChunk`] of a stage (its forward,
//! and the loss on the last one); wildfire's schedules (GPipe, 1F1B), the checker that proves
//! them deadlock-free and the executor run it. Each step cuts the batch into micro-batches, each
//! micro-batch's loss scaled by `1/m` so that the summed gradients are the batch mean's, as a
//! serial step's.
//!
//! The executor passes activations as `[.., .., ..]` tensors: a stage hands over its
//! `[points, width]` activation as `[1, points, width]`.
//!
//! With tensor parallelism as well (tp × pp ranks), the model is split by its plan
//! ([`crate::tensor_parallel::TP_PLAN`]) before it is cut: each stage's parallel layers keep
//! their tensor-parallel group, and a stage hands its tensor-parallel rank's part of an
//! activation to the same rank of the next stage. A stage's checkpoint names its parameters by
//! their paths in the whole model, so it loads into any other cut and degree.

use burn::module::{AutodiffModule, Module};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, Relu};
use burn::optim::{AdamWConfig, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use wildfire_backend::collective::CollectiveBackend;
use wildfire_parallel::Mesh;
use wildfire_parallel::device_value::read_values;
use wildfire_parallel::fsdp::ShardedUnit;
use wildfire_parallel::paths::PathStack;
use wildfire_parallel::pp::{PipelineChunk, Schedule, ScheduleKind, check, graphs_lock, run_step};

use crate::checkpoints;
use crate::mlp::{Block, LoopRun, Mlp, Points};
use crate::tensor_parallel;

/// One pipeline stage of the MLP: the input layer on the first stage, a run of hidden blocks,
/// the output layer on the last stage.
#[derive(Module, Debug)]
pub struct MlpStage<B: Backend> {
    input: Option<Linear<B>>,
    blocks: Vec<ShardedUnit<B, Block<B>>>,
    output: Option<Linear<B>>,
    activation: Relu,
}

/// A micro-batch and the factor its mean loss is scaled by (`1/m`).
#[derive(Debug, Clone)]
pub struct MicroBatch<B: Backend> {
    pub points: Points<B>,
    pub loss_scale: f64,
}

/// `model` cut into `cuts.len() + 1` stages, stage `s` holding hidden blocks
/// `cuts[s-1]..cuts[s]` (from 0, to the last): moved, not drawn again, so the stages are the
/// serial model's parts.
pub fn stages<B: Backend>(model: Mlp<B>, cuts: &[usize]) -> Vec<MlpStage<B>> {
    let (input, blocks, output, activation) = model.into_parts();
    let (mut input, mut output, mut blocks) = (Some(input), Some(output), blocks.into_iter());
    let starts = std::iter::once(0).chain(cuts.iter().copied());
    let ends = cuts.iter().copied().map(Some).chain([None]);
    let last = cuts.len();
    starts
        .zip(ends)
        .enumerate()
        .map(|(stage, (start, end))| MlpStage {
            input: input.take(),
            blocks: match end {
                Some(end) => blocks.by_ref().take(end - start).collect(),
                None => blocks.by_ref().collect(),
            },
            output: if stage == last { output.take() } else { None },
            activation: activation.clone(),
        })
        .collect()
}

impl<B: AutodiffBackend + CollectiveBackend> PipelineChunk<B> for MlpStage<B> {
    type Batch = MicroBatch<B>;

    fn forward(&self, input: Option<Tensor<B, 3>>, batch: &MicroBatch<B>) -> Tensor<B, 3> {
        let x = match (&self.input, input) {
            (Some(layer), None) => {
                let inputs = batch.points.inputs.clone();
                self.activation.forward(layer.forward(inputs))
            }
            (None, Some(x)) => x.squeeze_dim(0),
            _ => panic!("the first stage reads the batch, every other stage its input"),
        };
        let x =
            (self.blocks.iter()).fold(x, |x, block| block.forward(x, |block, x| block.forward(x)));
        match &self.output {
            Some(output) => output.forward(x),
            None => x,
        }
        .unsqueeze()
    }

    fn loss(&self, output: Tensor<B, 3>, batch: &MicroBatch<B>) -> (Tensor<B, 1>, Tensor<B, 1>) {
        let logits = output.squeeze_dim(0);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, batch.points.targets.clone())
            * batch.loss_scale;
        (loss.clone(), loss)
    }
}

/// Batch `step` of `run` cut into `m` micro-batches, each mean loss scaled by `1/m`.
pub fn micro_batches<B: AutodiffBackend>(
    run: &LoopRun,
    step: usize,
    m: usize,
) -> Vec<MicroBatch<B>> {
    let whole = run.batch::<B>(step);
    let size = run.batch / m;
    (0..m)
        .map(|mb| MicroBatch {
            points: Points {
                inputs: whole.inputs.clone().narrow(0, mb * size, size),
                targets: whole.targets.clone().narrow(0, mb * size, size),
            },
            loss_scale: 1.0 / m as f64,
        })
        .collect()
}

/// Trains `run` (its model drawn whole from its seed, split by its tensor-parallel plan over the
/// mesh's tensor group, cut at `cuts`) on this rank of `mesh`, one stage per pipeline rank, with
/// `kind`'s schedule of `m` micro-batches and Burn's AdamW on each stage, from the newest
/// checkpoint of the run if it has one: returns this rank's trained stage and the loss of every
/// step it took (the last stage's; 0 on the others).
pub fn train<B>(
    run: &LoopRun,
    cuts: &[usize],
    kind: ScheduleKind,
    m: usize,
    mesh: &Mesh,
) -> anyhow::Result<(MlpStage<B>, Vec<f64>)>
where
    B: AutodiffBackend + CollectiveBackend,
    MlpStage<B>: AutodiffModule<B>,
{
    let group = mesh.pipeline();
    let schedule = Schedule::build(kind, group.size(), 1, m)?;
    check(&schedule)?;
    let device = B::Device::default();
    let (model, layout) = tensor_parallel::build::<B>(run, false, mesh.tensor())?;
    let stage = {
        // Ranks that are threads of one process share Burn's autodiff registry.
        let _lock = graphs_lock();
        stages(model, cuts).swap_remove(group.rank())
    };
    let first_block = group.rank().checked_sub(1).map_or(0, |cut| cuts[cut]);
    let layout = layout.at(PathStack::numbered_from("blocks", first_block));
    let (mut stage, mut optimizer, start) = checkpoints::resume(
        run.checkpoints.as_ref(),
        &layout,
        stage,
        AdamWConfig::new().init(),
    )?;
    let mut losses = Vec::with_capacity(run.steps);
    for step in start..run.steps {
        let micro = micro_batches::<B>(run, step, m);
        let chunks = [stage];
        let result = run_step(&schedule, group.rank(), group, &chunks, &micro, &device)?;
        let [chunk] = chunks;
        // The step's loss stays on the device; all of them are read once, at the end.
        losses.push(result.loss);
        let grads = result.grads.into_iter().next().unwrap_or_default();
        {
            let _lock = graphs_lock();
            stage = optimizer.step(run.lr, chunk, grads);
        }
        checkpoints::save_when_due(
            run.checkpoints.as_ref(),
            step + 1,
            &layout,
            &stage,
            &optimizer,
            mesh.world(),
        )?;
    }
    Ok((stage, read_values(losses)))
}
