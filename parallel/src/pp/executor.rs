//! Running one rank's part of a checked [`Schedule`] for one optimizer step.
//!
//! Each rank holds its model chunks (local chunk `c` is global stage `c·pp + rank`) and walks
//! its action list in order: receive an activation, run a forward, send the output, receive an
//! output gradient, run a backward, send the input gradient. Sends return once queued (the host
//! transport), which is the semantics the schedule checker proved deadlock-free.
//!
//! **Backward from a received gradient.** Burn starts backpropagation from a scalar. A stage
//! whose output `y` receives the gradient `g = ∂L/∂y` from the next stage backpropagates the
//! scalar `⟨y, g⟩ = Σ yᵢgᵢ`, with `g` a constant: `∂⟨y, g⟩/∂θ = gᵀ ∂y/∂θ = ∂L/∂θ` for every
//! parameter θ of the stage, and the gradient reaching `y` is exactly `g` (the sum's backward
//! passes ones, the product's multiplies them by `g`), so no rounding is added. The stage's
//! input is a leaf that requires grad (the received activation, detached from the sender's
//! graph); its gradient `∂L/∂x` is what goes back to the previous stage.
//!
//! **Ranks as threads.** Burn 0.21 keeps one autodiff graph registry per process, and the cleanup
//! that follows every backward pass can drop another thread's graph entries while that thread
//! is building or merging a graph (its backward then finds no step for its root). Forwards and
//! backwards therefore run under one process-wide lock ([`AUTODIFF_GRAPHS`]): ranks that are
//! threads of one process compute one at a time (their communication still overlaps), which
//! keeps them correct but not faster than one rank; ranks in separate processes, the normal
//! case, never contend for it.
//!
//! **Activation checkpointing.** A chunk that is [`PipelineChunk::checkpointed`] runs its
//! forward outside the autodiff graph and keeps only the input of each of its segments
//! `x_{k+1} = s_k(θ, x_k)`. Its backward recomputes the segments last to first, each on a graph
//! of its own: `y = s_k(θ, x_k)` with `x_k` a fresh leaf, then backpropagates the loss (the last
//! stage's last segment) or `⟨y, g_{k+1}⟩`, which gives `g_k = ∂L/∂x_k` for the segment before
//! (the same identity as between stages). The activations alive at once are the segments'
//! inputs plus one segment's graph, for the price of one more forward. The recomputation repeats
//! the forward's operations in the same order, so every segment's gradients are bitwise those
//! of the plain backward. A parameter two segments use (a tied embedding on one stage) gets its
//! two parts added per micro-batch, as inside the plain backward (`a + b = b + a` exactly), so
//! the step's gradients are bitwise the plain ones too.
//!
//! **Accumulation and memory.** Parameter gradients of every micro-batch are summed per chunk
//! (each micro-batch's loss is already scaled by the caller, e.g. `1/tokens of the step`). A
//! forward's graph and its saved input live until its backward, then are dropped; the number of
//! forwards alive at once is the "in-flight activations" the schedule bounds.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::module::{AutodiffModule, ModuleMapper, Param};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Float, Tensor};
use wildfire_backend::comm::{CommError, ProcessGroup};

use super::schedule::{Action, Schedule};
use crate::device_value::{fold_sum, inner_device_of};

/// Serialises autodiff graph building and backward passes within a process (see the module
/// doc). Anything else that registers autodiff nodes while ranks run as threads (a parameter
/// made to require grad, e.g. by an optimizer step or when a model is built) takes it too.
pub static AUTODIFF_GRAPHS: Mutex<()> = Mutex::new(());

pub fn graphs_lock() -> MutexGuard<'static, ()> {
    AUTODIFF_GRAPHS.lock().unwrap_or_else(|p| p.into_inner())
}

/// One model chunk as the pipeline runs it: a contiguous run of a model's layers.
pub trait PipelineChunk<B: Backend> {
    /// A micro-batch, as every stage sees it (the first stage reads the inputs, the last the
    /// targets).
    type Batch;

    /// The chunk's output: from the batch on the first stage (`input` is `None`), from the
    /// previous stage's output otherwise.
    fn forward(&self, input: Option<Tensor<B, 3>>, batch: &Self::Batch) -> Tensor<B, 3>;

    /// On the last stage: the micro-batch's loss, as the scalar to backpropagate and as the
    /// value to report, both one-element tensors. The reported value stays on the device: the
    /// executor sums it over the micro-batches there, and the caller reads the sum when it logs.
    fn loss(&self, output: Tensor<B, 3>, batch: &Self::Batch) -> (Tensor<B, 1>, Tensor<B, 1>);

    /// How many checkpoint segments the chunk's forward is cut into when it is checkpointed
    /// (see [`PipelineChunk::checkpointed`]), e.g. one per transformer block; at least 1.
    fn segments(&self) -> usize {
        1
    }

    /// Segment `k` of the forward: `forward(input) = s_{n−1}(… s_1(s_0(input)))`, where the
    /// first segment receives the chunk's input (`None` on the first stage).
    fn forward_segment(
        &self,
        segment: usize,
        input: Option<Tensor<B, 3>>,
        batch: &Self::Batch,
    ) -> Tensor<B, 3> {
        debug_assert_eq!(segment, 0, "a chunk of one segment");
        self.forward(input, batch)
    }

    /// Whether the executor keeps only each segment's input from the forward and recomputes the
    /// segment in the backward (full activation checkpointing, see the module doc). The
    /// segments must then be deterministic (no dropout), as the recomputation repeats them.
    fn checkpointed(&self) -> bool {
        false
    }
}

/// Why a pipeline step failed: the rank, the action and its cause.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("pipeline rank {rank}, action {index} ({action}): {source}")]
    Comm {
        rank: usize,
        index: usize,
        action: Action,
        source: Box<CommError>,
    },
    #[error("pipeline rank {rank}, action {index} ({action}): {detail}")]
    Order {
        rank: usize,
        index: usize,
        action: Action,
        detail: String,
    },
    #[error("pipeline rank {rank}, at the end of the step: {source}")]
    StepEnd { rank: usize, source: Box<CommError> },
    #[error(
        "pipeline rank {rank} holds {chunks} chunks and got {batches} micro-batches, but the \
         schedule has {virtual_stages} chunks per rank and {microbatches} micro-batches"
    )]
    Shape {
        rank: usize,
        chunks: usize,
        batches: usize,
        virtual_stages: usize,
        microbatches: usize,
    },
}

/// What one rank measured during a step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepStats {
    /// Time spent in forwards and backwards.
    pub busy: Duration,
    /// Time of the whole step: from this rank's start until every rank is done.
    pub wall: Duration,
    /// Most forwards alive (forward done, backward not yet) at once.
    pub peak_activations: usize,
}

impl StepStats {
    /// The measured bubble: the fraction of the step (until the last rank is done) this rank
    /// was not computing.
    pub fn bubble(&self) -> f64 {
        let wall = self.wall.as_secs_f64();
        if wall > 0.0 {
            1.0 - self.busy.as_secs_f64() / wall
        } else {
            0.0
        }
    }
}

/// The result of a rank's step: each chunk's summed parameter gradients, the summed loss, and
/// the measurements.
#[derive(Debug)]
pub struct StepResult<B: Backend> {
    pub grads: Vec<GradientsParams>,
    /// The sum of the reported micro-batch losses on the last stage (0 elsewhere), on the
    /// device, folded in micro-batch order in its widest float ([`crate::device_value`]).
    pub loss: Tensor<B, 1>,
    pub stats: StepStats,
}

/// Message tags: the consuming stage and the micro-batch, per direction.
fn tag(gradient: bool, stage: usize, mb: usize) -> u64 {
    (u64::from(gradient) << 62) | ((stage as u64) << 32) | mb as u64
}

/// Gives every float parameter a fresh graph leaf (same value, same [`ParamId`]).
///
/// Burn 0.21's autodiff frees the graph nodes a backward pass consumed, and when several forward
/// graphs are pending at once (the pipeline's in-flight micro-batches) and share parameter nodes,
/// a backward pass can leave the others' roots freed ("Node should have a step registered").
/// Each micro-batch's forward therefore runs on a copy of the chunk whose parameters are leaves
/// of its own graph; the copies share the parameters' data, and gradients, keyed by `ParamId`,
/// accumulate onto the chunk as usual.
struct FreshLeaves;

impl<B: AutodiffBackend> ModuleMapper<B> for FreshLeaves {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let leaf = if tensor.is_require_grad() {
            tensor.detach().require_grad()
        } else {
            tensor
        };
        Param::from_mapped_value(id, leaf, mapper)
    }
}

/// Replaces every float parameter by the same values outside the autodiff graph (same
/// [`ParamId`]): a checkpointed forward records nothing.
struct Untracked;

impl<B: AutodiffBackend> ModuleMapper<B> for Untracked {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        Param::from_mapped_value(id, Tensor::from_inner(tensor.inner()), mapper)
    }
}

/// What a forward leaves for its backward.
enum Saved<B: AutodiffBackend, C> {
    Graph {
        /// The chunk copy the forward ran on (see [`FreshLeaves`]).
        module: C,
        /// The input leaf (every stage but the first).
        input: Option<Tensor<B, 3>>,
        /// The loss (last stage) or the output (other stages).
        output: Output<B>,
    },
    /// A checkpointed forward: each segment's input, outside the graph (see the module doc).
    Checkpoints(Vec<Option<Tensor<B::InnerBackend, 3>>>),
}

enum Output<B: AutodiffBackend> {
    Loss(Tensor<B, 1>),
    Activation(Tensor<B, 3>),
}

/// One rank's state while it runs its actions.
struct RankRun<'a, B: AutodiffBackend, C: PipelineChunk<B> + AutodiffModule<B>> {
    schedule: &'a Schedule,
    rank: usize,
    group: &'a ProcessGroup,
    chunks: &'a [C],
    batches: &'a [C::Batch],
    device: B::Device,
    /// Inputs waiting for their forward, by (micro-batch, chunk).
    inputs: HashMap<(usize, usize), Tensor<B::InnerBackend, 3>>,
    /// Gradients of outputs waiting for their backward.
    output_grads: HashMap<(usize, usize), Tensor<B::InnerBackend, 3>>,
    /// Outputs and input gradients waiting to be sent.
    outbox: HashMap<(bool, usize, usize), Tensor<B::InnerBackend, 3>>,
    saved: HashMap<(usize, usize), Saved<B, C>>,
    accumulators: Vec<GradientsAccumulator<C>>,
    /// The reported losses of the micro-batches so far (last stage).
    losses: Vec<Tensor<B::InnerBackend, 1>>,
    stats: StepStats,
}

/// Runs `rank`'s actions of `schedule` for one step: `chunks[c]` is local chunk `c`,
/// `batches[mb]` micro-batch `mb`, `group` the pipeline group (group rank = pipeline rank).
pub fn run_step<B, C>(
    schedule: &Schedule,
    rank: usize,
    group: &ProcessGroup,
    chunks: &[C],
    batches: &[C::Batch],
    device: &B::Device,
) -> Result<StepResult<B::InnerBackend>, PipelineError>
where
    B: AutodiffBackend,
    C: PipelineChunk<B> + AutodiffModule<B>,
{
    if chunks.len() != schedule.virtual_stages || batches.len() != schedule.microbatches {
        return Err(PipelineError::Shape {
            rank,
            chunks: chunks.len(),
            batches: batches.len(),
            virtual_stages: schedule.virtual_stages,
            microbatches: schedule.microbatches,
        });
    }
    let started = Instant::now();
    let mut run = RankRun {
        schedule,
        rank,
        group,
        chunks,
        batches,
        device: device.clone(),
        inputs: HashMap::new(),
        output_grads: HashMap::new(),
        outbox: HashMap::new(),
        saved: HashMap::new(),
        accumulators: chunks.iter().map(|_| GradientsAccumulator::new()).collect(),
        losses: Vec::new(),
        stats: StepStats::default(),
    };
    for (index, action) in schedule.actions[rank].iter().enumerate() {
        run.perform(*action)
            .map_err(|cause| cause.at(rank, index, *action))?;
    }
    // The step ends when the last rank is done: a rank that finishes early is idle until then.
    group.barrier().map_err(|source| PipelineError::StepEnd {
        rank,
        source: Box::new(source),
    })?;
    run.stats.wall = started.elapsed();
    let inner_device = inner_device_of::<B>(device);
    Ok(StepResult {
        grads: run.accumulators.iter_mut().map(|a| a.grads()).collect(),
        loss: fold_sum(run.losses, &inner_device),
        stats: run.stats,
    })
}

/// An action's failure before the rank and index are attached.
enum Failure {
    Comm(CommError),
    Order(String),
}

impl From<CommError> for Failure {
    fn from(error: CommError) -> Self {
        Failure::Comm(error)
    }
}

impl Failure {
    fn at(self, rank: usize, index: usize, action: Action) -> PipelineError {
        match self {
            Failure::Comm(source) => PipelineError::Comm {
                rank,
                index,
                action,
                source: Box::new(source),
            },
            Failure::Order(detail) => PipelineError::Order {
                rank,
                index,
                action,
                detail,
            },
        }
    }
}

fn take<K: std::hash::Hash + Eq, V>(
    map: &mut HashMap<K, V>,
    key: K,
    what: &str,
) -> Result<V, Failure> {
    map.remove(&key)
        .ok_or_else(|| Failure::Order(format!("{what} is not available")))
}

impl<B, C> RankRun<'_, B, C>
where
    B: AutodiffBackend,
    C: PipelineChunk<B> + AutodiffModule<B>,
{
    fn last_stage(&self) -> usize {
        self.schedule.num_stages() - 1
    }

    fn perform(&mut self, action: Action) -> Result<(), Failure> {
        let stage = self.schedule.stage_of(self.rank, action.chunk());
        match action {
            Action::RecvActivation { mb, chunk, from } => {
                let x = self.group.recv::<B::InnerBackend, 3, Float>(
                    from,
                    tag(false, stage, mb),
                    &self.device,
                )?;
                self.inputs.insert((mb, chunk), x);
            }
            Action::Forward { mb, chunk } => self.forward(mb, chunk, stage)?,
            Action::SendActivation { mb, chunk, to } => {
                let y = take(&mut self.outbox, (false, mb, chunk), "the output")?;
                self.group.send(y, to, tag(false, stage + 1, mb))?;
            }
            Action::RecvGradient { mb, chunk, from } => {
                let g = self.group.recv::<B::InnerBackend, 3, Float>(
                    from,
                    tag(true, stage, mb),
                    &self.device,
                )?;
                self.output_grads.insert((mb, chunk), g);
            }
            Action::Backward { mb, chunk } => self.backward(mb, chunk, stage)?,
            Action::SendGradient { mb, chunk, to } => {
                let g = take(&mut self.outbox, (true, mb, chunk), "the input gradient")?;
                self.group.send(g, to, tag(true, stage - 1, mb))?;
            }
        }
        Ok(())
    }

    fn forward(&mut self, mb: usize, chunk: usize, stage: usize) -> Result<(), Failure> {
        let input = match stage {
            0 => None,
            _ => Some(take(&mut self.inputs, (mb, chunk), "the input activation")?),
        };
        let graphs = graphs_lock();
        let started = Instant::now();
        let saved = if self.chunks[chunk].checkpointed() {
            self.forward_checkpointed(mb, chunk, stage, input)
        } else {
            self.forward_with_graph(mb, chunk, stage, input)
        };
        self.stats.busy += started.elapsed();
        drop(graphs);
        self.saved.insert((mb, chunk), saved);
        self.stats.peak_activations = self.stats.peak_activations.max(self.saved.len());
        Ok(())
    }

    /// Passes a non-last stage's output on: to this rank's next chunk in memory (one pipeline
    /// rank), or to the outbox.
    fn hand_on(&mut self, mb: usize, chunk: usize, output: Tensor<B::InnerBackend, 3>) {
        if self.schedule.stages == 1 {
            self.inputs.insert((mb, chunk + 1), output);
        } else {
            self.outbox.insert((false, mb, chunk), output);
        }
    }

    fn forward_with_graph(
        &mut self,
        mb: usize,
        chunk: usize,
        stage: usize,
        input: Option<Tensor<B::InnerBackend, 3>>,
    ) -> Saved<B, C> {
        // The input becomes a leaf of this stage's graph (registering it needs the lock).
        let input = input.map(|x| Tensor::<B, 3>::from_inner(x).require_grad());
        let module = self.chunks[chunk].clone().map(&mut FreshLeaves);
        let output = module.forward(input.clone(), &self.batches[mb]);
        let output = if stage == self.last_stage() {
            let (loss, value) = module.loss(output, &self.batches[mb]);
            self.losses.push(value.inner());
            Output::Loss(loss)
        } else {
            self.hand_on(mb, chunk, output.clone().inner());
            Output::Activation(output)
        };
        Saved::Graph {
            module,
            input,
            output,
        }
    }

    fn forward_checkpointed(
        &mut self,
        mb: usize,
        chunk: usize,
        stage: usize,
        input: Option<Tensor<B::InnerBackend, 3>>,
    ) -> Saved<B, C> {
        let module = self.chunks[chunk].clone().map(&mut Untracked);
        let batch = &self.batches[mb];
        let mut inputs = Vec::new();
        let mut x = input;
        for segment in 0..module.segments() {
            inputs.push(x.clone());
            x = Some(
                module
                    .forward_segment(segment, x.map(Tensor::from_inner), batch)
                    .inner(),
            );
        }
        let output = x.expect("at least one segment");
        if stage == self.last_stage() {
            let value = module.loss(Tensor::from_inner(output), batch).1;
            self.losses.push(value.inner());
        } else {
            self.hand_on(mb, chunk, output);
        }
        Saved::Checkpoints(inputs)
    }

    fn backward(&mut self, mb: usize, chunk: usize, stage: usize) -> Result<(), Failure> {
        let saved = take(
            &mut self.saved,
            (mb, chunk),
            "the forward of this micro-batch",
        )?;
        let output_grad = match stage == self.last_stage() {
            true => None,
            false => Some(take(
                &mut self.output_grads,
                (mb, chunk),
                "the output gradient",
            )?),
        };
        let graphs = graphs_lock();
        let started = Instant::now();
        let input_grad = match saved {
            Saved::Graph {
                module,
                input,
                output,
            } => {
                let (input_grad, grads) = backpropagate(&module, input, output, output_grad);
                self.accumulators[chunk].accumulate(&self.chunks[chunk], grads);
                input_grad
            }
            Saved::Checkpoints(inputs) => {
                self.backward_checkpointed(mb, chunk, inputs, output_grad)?
            }
        };
        if stage > 0 {
            let input_grad = input_grad.ok_or_else(|| {
                Failure::Order(format!(
                    "no gradient reached the input of stage {stage}: the chunk does not use it"
                ))
            })?;
            if self.schedule.stages == 1 {
                self.output_grads.insert((mb, chunk - 1), input_grad);
            } else {
                self.outbox.insert((true, mb, chunk), input_grad);
            }
        }
        self.stats.busy += started.elapsed();
        drop(graphs);
        Ok(())
    }

    /// The backward of a checkpointed forward: each segment recomputed with a graph and
    /// backpropagated, last to first (see the module doc). The segments' parameter gradients
    /// are summed over the micro-batch before they join the chunk's sum, the order of the plain
    /// backward (a parameter two segments use, a tied embedding, gets `a + b` per micro-batch).
    fn backward_checkpointed(
        &mut self,
        mb: usize,
        chunk: usize,
        inputs: Vec<Option<Tensor<B::InnerBackend, 3>>>,
        mut output_grad: Option<Tensor<B::InnerBackend, 3>>,
    ) -> Result<Option<Tensor<B::InnerBackend, 3>>, Failure> {
        let last = inputs.len() - 1;
        let mut input_grad = None;
        let mut micro_batch = GradientsAccumulator::new();
        for (segment, input) in inputs.into_iter().enumerate().rev() {
            let module = self.chunks[chunk].clone().map(&mut FreshLeaves);
            let batch = &self.batches[mb];
            let input = input.map(|x| Tensor::<B, 3>::from_inner(x).require_grad());
            let y = module.forward_segment(segment, input.clone(), batch);
            let output = match (segment == last, &output_grad) {
                (true, None) => Output::Loss(module.loss(y, batch).0),
                _ => Output::Activation(y),
            };
            let grads;
            (input_grad, grads) = backpropagate(&module, input, output, output_grad.take());
            micro_batch.accumulate(&self.chunks[chunk], grads);
            if segment > 0 && input_grad.is_none() {
                return Err(Failure::Order(format!(
                    "no gradient reached the input of checkpoint segment {segment}: the segment \
                     does not use it"
                )));
            }
            output_grad = input_grad.clone();
        }
        self.accumulators[chunk].accumulate(&self.chunks[chunk], micro_batch.grads());
        Ok(input_grad)
    }
}

/// Backpropagates the loss, or `⟨y, g⟩` for an output `y` with gradient `g`, through `module`
/// (a copy of a chunk with fresh leaves); returns the gradient of `input` and the parameters'.
fn backpropagate<B: AutodiffBackend, C: AutodiffModule<B>>(
    module: &C,
    input: Option<Tensor<B, 3>>,
    output: Output<B>,
    output_grad: Option<Tensor<B::InnerBackend, 3>>,
) -> (Option<Tensor<B::InnerBackend, 3>>, GradientsParams) {
    let root = match (output, output_grad) {
        (Output::Loss(loss), _) => loss,
        (Output::Activation(y), Some(g)) => (y * Tensor::from_inner(g)).sum(),
        (Output::Activation(_), None) => unreachable!("taken by the caller for activations"),
    };
    let grads = root.backward();
    let input_grad = input.and_then(|x| x.grad(&grads));
    (input_grad, GradientsParams::from_grads(grads, module))
}

/// The summed loss of `batches` through the pipeline, forward only (evaluation): micro-batch
/// after micro-batch, stage after stage, each rank running the stages it holds. The loss, on
/// the device, is known on the last stage's rank (0 elsewhere).
pub fn run_forward<B, C>(
    pp: usize,
    rank: usize,
    group: &ProcessGroup,
    chunks: &[C],
    batches: &[C::Batch],
    device: &B::Device,
) -> Result<Tensor<B, 1>, PipelineError>
where
    B: Backend,
    C: PipelineChunk<B>,
{
    let stages = pp * chunks.len();
    let mut losses = Vec::new();
    for (mb, batch) in batches.iter().enumerate() {
        let mut x = None;
        for stage in (rank..stages).step_by(pp) {
            let chunk = stage / pp;
            let fail = |source| PipelineError::Comm {
                rank,
                index: mb,
                action: Action::Forward { mb, chunk },
                source: Box::new(source),
            };
            if stage > 0 && pp > 1 {
                let from = (stage - 1) % pp;
                x = Some(
                    group
                        .recv::<B, 3, Float>(from, tag(false, stage, mb), device)
                        .map_err(fail)?,
                );
            }
            let y = chunks[chunk].forward(x.take(), batch);
            if stage + 1 == stages {
                losses.push(chunks[chunk].loss(y, batch).1);
            } else if pp > 1 {
                group
                    .send(y, (stage + 1) % pp, tag(false, stage + 1, mb))
                    .map_err(fail)?;
            } else {
                x = Some(y);
            }
        }
    }
    Ok(fold_sum(losses, device))
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::{AdamWConfig, GradientsAccumulator, Optimizer};
    use burn::tensor::Distribution;

    use super::*;
    use crate::pp::{Schedule, ScheduleKind};
    use wildfire_backend::comm::CommOptions;

    type B = Autodiff<Flex>;

    #[derive(Module, Debug)]
    struct Stage<B: Backend> {
        linear: Linear<B>,
    }

    impl PipelineChunk<B> for Stage<B> {
        type Batch = Tensor<B, 3>;

        fn forward(&self, input: Option<Tensor<B, 3>>, batch: &Tensor<B, 3>) -> Tensor<B, 3> {
            self.linear.forward(input.unwrap_or_else(|| batch.clone()))
        }

        fn loss(&self, output: Tensor<B, 3>, _: &Tensor<B, 3>) -> (Tensor<B, 1>, Tensor<B, 1>) {
            let loss = output.powi_scalar(2).sum();
            (loss.clone(), loss)
        }
    }

    /// The pattern that loses graph roots in Burn 0.21 without fresh parameter leaves: eight
    /// pending forwards from leaf inputs through shared parameters, then their backwards, over
    /// optimizer steps (it panics there with "Node should have a step registered").
    #[test]
    fn pending_graphs_on_fresh_leaves_keep_their_roots() {
        let device = Default::default();
        let mut stage = Stage::<B> {
            linear: LinearConfig::new(8, 8).init(&device),
        };
        let mut optimizer = AdamWConfig::new().init::<B, Stage<B>>();
        let batch = Tensor::<B, 3>::zeros([1, 4, 8], &device);
        for round in 0..3 {
            let inputs: Vec<Tensor<B, 3>> = (0..8)
                .map(|_| Tensor::random([1, 4, 8], Distribution::Default, &device).require_grad())
                .collect();
            let pending: Vec<_> = inputs
                .iter()
                .map(|x| {
                    let copy = stage.clone().map(&mut FreshLeaves);
                    let output = PipelineChunk::forward(&copy, Some(x.clone()), &batch);
                    (copy.output_sum(output), copy)
                })
                .collect();
            let mut accumulator = GradientsAccumulator::new();
            for (mb, (loss, copy)) in pending.into_iter().enumerate() {
                let grads = loss.backward();
                assert!(inputs[mb].grad(&grads).is_some(), "round {round} mb {mb}");
                accumulator.accumulate(&stage, GradientsParams::from_grads(grads, &copy));
            }
            stage = optimizer.step(1e-2, stage, accumulator.grads());
        }
    }

    impl Stage<B> {
        fn output_sum(&self, output: Tensor<B, 3>) -> Tensor<B, 1> {
            output.sum()
        }
    }

    /// GPipe on one rank keeps all 8 forward graphs pending before the first backward, over
    /// several optimizer steps; the gradients equal forward-then-backward per micro-batch.
    #[test]
    fn pending_forwards_accumulate_like_one_at_a_time() {
        let device = Default::default();
        let mut stage = Stage::<B> {
            linear: LinearConfig::new(8, 8).init(&device),
        };
        let mut optimizer = AdamWConfig::new().init::<B, Stage<B>>();
        let world = ProcessGroup::local_world(1, CommOptions::default())
            .unwrap()
            .remove(0);
        let schedule = Schedule::build(ScheduleKind::GPipe, 1, 1, 8).unwrap();
        let batches: Vec<Tensor<B, 3>> = (0..8)
            .map(|_| Tensor::random([2, 3, 8], Distribution::Default, &device))
            .collect();
        for _ in 0..3 {
            let mut expected = GradientsAccumulator::new();
            for batch in &batches {
                let (loss, _) = stage.loss(PipelineChunk::forward(&stage, None, batch), batch);
                expected.accumulate(&stage, GradientsParams::from_grads(loss.backward(), &stage));
            }
            let mut expected = expected.grads();
            let mut result = run_step(&schedule, 0, &world, &[stage.clone()], &batches, &device)
                .expect("a pipeline step");
            assert_eq!(result.stats.peak_activations, 8);
            let mut grads = result.grads.remove(0);
            let id = stage.linear.weight.id;
            let (got, want) = (
                grads.remove::<Flex, 2>(id).unwrap().into_data(),
                expected.remove::<Flex, 2>(id).unwrap().into_data(),
            );
            assert_eq!(got, want);
            stage = optimizer.step(1e-2, stage, expected);
        }
    }
}
