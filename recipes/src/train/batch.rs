//! Batches of token windows, the model's train/eval step, and the burn-train data loaders that
//! feed them from the [`Sampler`].

use std::sync::{Arc, Mutex, MutexGuard};

use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn::train::{InferenceStep, TrainOutput, TrainStep};

use wildfire_parallel::device_value::read_value;
use wildfire_parallel::pp::PipelineChunk;

use crate::TrainBackend;
use crate::data::{Sampler, Tokens};
use crate::logging::StepOutput;
use crate::model::{Gpt, GptChunks};
use wildfire_backend::DecoratedBackend;

/// Input windows `[batch, context]`, their next-token targets, and the factor that turns this
/// batch's summed loss into its share of the step's mean: `1 / (tokens in the whole step)`.
#[derive(Debug, Clone)]
pub struct TokenBatch<B: Backend> {
    pub inputs: Tensor<B, 2, Int>,
    pub targets: Tensor<B, 2, Int>,
    pub loss_scale: f64,
}

impl<B: Backend> TokenBatch<B> {
    /// The windows of `context + 1` tokens starting at `starts`.
    pub fn from_windows(
        tokens: &Tokens,
        starts: &[usize],
        context: usize,
        device: &B::Device,
    ) -> Self {
        let mut inputs = Vec::with_capacity(starts.len() * context);
        let mut targets = Vec::with_capacity(starts.len() * context);
        let mut window = Vec::with_capacity(context + 1);
        for &start in starts {
            window.clear();
            tokens.extend_from(start, context + 1, &mut window);
            inputs.extend(window[..context].iter().map(|&t| t as i64));
            targets.extend(window[1..].iter().map(|&t| t as i64));
        }
        let shape = [starts.len(), context];
        Self {
            inputs: Tensor::from_data(TensorData::new(inputs, shape), device),
            targets: Tensor::from_data(TensorData::new(targets, shape), device),
            loss_scale: 1.0 / (starts.len() * context) as f64,
        }
    }

    pub fn tokens(&self) -> usize {
        self.targets.shape().num_elements()
    }
}

/// The summed token loss of a batch (a one-element tensor) and its token count.
fn batch_loss<B: DecoratedBackend>(
    model: &GptChunks<B>,
    batch: &TokenBatch<B>,
) -> (Tensor<B, 1>, usize) {
    let loss = model.loss_sum(batch.inputs.clone(), batch.targets.clone());
    (loss, batch.tokens())
}

/// burn-train's single-device step, for a rank that holds every stage. The recipe's loop runs
/// its steps through the pipeline executor instead (see [`PipelineChunk`] below), which does the
/// same arithmetic on one rank.
impl<B: TrainBackend> TrainStep for GptChunks<B> {
    type Input = TokenBatch<B>;
    type Output = StepOutput;

    /// Forward and backward of one micro-batch. The gradient is that of `loss_scale · Σ losses`,
    /// so summing the micro-batches' gradients gives the gradient of the step's mean token loss.
    fn step(&self, batch: TokenBatch<B>) -> TrainOutput<StepOutput> {
        let (loss_sum, tokens) = batch_loss(self, &batch);
        let grads = (loss_sum.clone() * batch.loss_scale).backward();
        let loss_sum = read_value(loss_sum);
        TrainOutput::new(
            self,
            grads,
            StepOutput {
                loss_sum,
                tokens,
                ..Default::default()
            },
        )
    }
}

impl<B: DecoratedBackend> InferenceStep for GptChunks<B> {
    type Input = TokenBatch<B>;
    type Output = StepOutput;

    fn step(&self, batch: TokenBatch<B>) -> StepOutput {
        let (loss_sum, tokens) = batch_loss(self, &batch);
        StepOutput {
            loss_sum: read_value(loss_sum),
            tokens,
            ..Default::default()
        }
    }
}

/// A GPT stage in the pipeline: the first stage embeds the batch's inputs, the last applies the
/// head and scores the targets. The loss to backpropagate is `loss_scale · Σ token losses`, the
/// value reported is `Σ token losses` (on the device; the loop reads it when it logs).
impl<B: DecoratedBackend> PipelineChunk<B> for Gpt<B> {
    type Batch = TokenBatch<B>;

    fn forward(&self, input: Option<Tensor<B, 3>>, batch: &TokenBatch<B>) -> Tensor<B, 3> {
        let x = input.unwrap_or_else(|| self.embed(batch.inputs.clone()));
        self.run_blocks(x)
    }

    /// One segment per block (the first also embeds on the first stage; a stage without blocks
    /// is one segment).
    fn segments(&self) -> usize {
        self.blocks.len().max(1)
    }

    fn forward_segment(
        &self,
        segment: usize,
        input: Option<Tensor<B, 3>>,
        batch: &TokenBatch<B>,
    ) -> Tensor<B, 3> {
        let x = input.unwrap_or_else(|| self.embed(batch.inputs.clone()));
        match self.blocks.get(segment) {
            Some(block) => block.forward(x, &self.tp),
            None => x,
        }
    }

    fn checkpointed(&self) -> bool {
        self.recompute_blocks
    }

    fn loss(&self, output: Tensor<B, 3>, batch: &TokenBatch<B>) -> (Tensor<B, 1>, Tensor<B, 1>) {
        let loss_sum = self.head_loss_sum(output, batch.targets.clone());
        (loss_sum.clone() * batch.loss_scale, loss_sum)
    }
}

/// Training micro-batches drawn from a shared [`Sampler`], without end: each global batch of the
/// sampler is cut into micro-batches of `micro_batch` windows. The sampler is shared with the
/// training loop, which saves its cursor in checkpoints.
#[derive(Debug, Clone)]
pub struct TrainLoader<B: Backend> {
    tokens: Tokens,
    sampler: Arc<Mutex<Sampler>>,
    micro_batch: usize,
    context: usize,
    max_steps: usize,
    device: B::Device,
}

impl<B: Backend> TrainLoader<B> {
    pub fn new(
        tokens: Tokens,
        sampler: Arc<Mutex<Sampler>>,
        micro_batch: usize,
        context: usize,
        max_steps: usize,
        device: B::Device,
    ) -> Self {
        Self {
            tokens,
            sampler,
            micro_batch,
            context,
            max_steps,
            device,
        }
    }

    fn sampler(&self) -> MutexGuard<'_, Sampler> {
        self.sampler
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

struct TrainIter<'a, B: Backend> {
    loader: &'a TrainLoader<B>,
    pending: std::vec::IntoIter<usize>,
}

impl<B: Backend> Iterator for TrainIter<'_, B> {
    type Item = TokenBatch<B>;

    fn next(&mut self) -> Option<TokenBatch<B>> {
        if self.pending.len() == 0 {
            self.pending = self.loader.sampler().next_batch().into_iter();
        }
        let starts: Vec<usize> = self
            .pending
            .by_ref()
            .take(self.loader.micro_batch)
            .collect();
        let loader = self.loader;
        Some(TokenBatch::from_windows(
            &loader.tokens,
            &starts,
            loader.context,
            &loader.device,
        ))
    }
}

impl<B: Backend> DataLoaderIterator<TokenBatch<B>> for TrainIter<'_, B> {
    fn progress(&self) -> Progress {
        let sampler = self.loader.sampler();
        let cursor = sampler.cursor();
        let done = cursor.epoch * sampler.batches_per_epoch() + cursor.batch;
        Progress::new(done as usize, self.loader.max_steps)
    }
}

impl<B: Backend> DataLoader<B, TokenBatch<B>> for TrainLoader<B> {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<TokenBatch<B>> + 'a> {
        Box::new(TrainIter {
            loader: self,
            pending: Vec::new().into_iter(),
        })
    }

    fn num_items(&self) -> usize {
        self.max_steps * self.sampler().batches_per_epoch().max(1) as usize
    }

    fn to_device(&self, device: &B::Device) -> Arc<dyn DataLoader<B, TokenBatch<B>>> {
        Arc::new(Self {
            device: device.clone(),
            ..self.clone()
        })
    }

    /// The stream is endless and shared; a slice of it is the stream itself.
    fn slice(&self, _start: usize, _end: usize) -> Arc<dyn DataLoader<B, TokenBatch<B>>> {
        Arc::new(self.clone())
    }
}

/// The fixed validation batches: the first `batches · micro_batch` windows of the held-out
/// tokens, in order, so every evaluation measures the same data.
#[derive(Debug, Clone)]
pub struct EvalLoader<B: Backend> {
    tokens: Tokens,
    /// Where the first window starts (a slice of the loader starts later).
    first: usize,
    micro_batch: usize,
    context: usize,
    batches: usize,
    device: B::Device,
}

impl<B: Backend> EvalLoader<B> {
    /// As many of `batches` as the validation tokens hold (at least one window each).
    pub fn new(
        tokens: Tokens,
        micro_batch: usize,
        context: usize,
        batches: usize,
        device: B::Device,
    ) -> Self {
        let windows = tokens.len().saturating_sub(1) / context;
        let batches = batches.min(windows.div_ceil(micro_batch));
        Self {
            tokens,
            first: 0,
            micro_batch,
            context,
            batches,
            device,
        }
    }

    fn batch(&self, index: usize) -> TokenBatch<B> {
        let windows = (self.tokens.len() - self.first - 1) / self.context;
        let first = index * self.micro_batch;
        let starts: Vec<usize> = (first..(first + self.micro_batch).min(windows))
            .map(|w| self.first + w * self.context)
            .collect();
        TokenBatch::from_windows(&self.tokens, &starts, self.context, &self.device)
    }
}

struct EvalIter<'a, B: Backend> {
    loader: &'a EvalLoader<B>,
    next: usize,
}

impl<B: Backend> Iterator for EvalIter<'_, B> {
    type Item = TokenBatch<B>;
    fn next(&mut self) -> Option<TokenBatch<B>> {
        (self.next < self.loader.batches).then(|| {
            self.next += 1;
            self.loader.batch(self.next - 1)
        })
    }
}

impl<B: Backend> DataLoaderIterator<TokenBatch<B>> for EvalIter<'_, B> {
    fn progress(&self) -> Progress {
        Progress::new(self.next, self.loader.batches)
    }
}

impl<B: Backend> DataLoader<B, TokenBatch<B>> for EvalLoader<B> {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<TokenBatch<B>> + 'a> {
        Box::new(EvalIter {
            loader: self,
            next: 0,
        })
    }

    fn num_items(&self) -> usize {
        self.batches
    }

    fn to_device(&self, device: &B::Device) -> Arc<dyn DataLoader<B, TokenBatch<B>>> {
        Arc::new(Self {
            device: device.clone(),
            ..self.clone()
        })
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<B, TokenBatch<B>>> {
        let batches = end.min(self.batches).saturating_sub(start);
        let skip = start * self.micro_batch * self.context;
        Arc::new(Self {
            first: (self.first + skip).min(self.tokens.len().saturating_sub(1)),
            batches,
            ..self.clone()
        })
    }
}
