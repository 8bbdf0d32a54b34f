//! The optimizer side of the recipe: AdamW with weight decay on matrices only and the warmup +
//! cosine learning-rate schedule (global gradient-norm clipping is `wildfire_parallel::clip`).

use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::{AdamWState, AdaptiveMomentumState, SimpleOptimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use wildfire_backend::kernels::adamw::FusedAdamW;
use wildfire_parallel::checkpoint::optimizer::MomentState;
use wildfire_parallel::learner_update::LearnerUpdate;
use wildfire_parallel::update::Update;

use crate::config::TrainSection;
use crate::model::GptChunks;

/// AdamW that decays only tensors of rank ≥ 2 (weight matrices and embeddings), never biases or
/// LayerNorm gains, as GPT-2 reproductions do. Both halves share Burn's AdamW update
/// `θ ← θ(1 − η·λ) − η·m̂/(√v̂ + ε)`, run as one fused pass per parameter where `train.fused`
/// says so ([`FusedAdamW`]: bit for bit Burn's on the CPU, one kernel on wgpu and CUDA); only λ
/// differs.
#[derive(Clone)]
pub struct MatrixDecayAdamW {
    matrices: FusedAdamW,
    vectors: FusedAdamW,
}

impl MatrixDecayAdamW {
    /// The config's AdamW, its step fused (`fused`) or Burn's.
    pub fn new(train: &TrainSection, fused: bool) -> Self {
        let matrices = FusedAdamW::new(
            train.beta1 as f32,
            train.beta2 as f32,
            train.eps as f32,
            train.weight_decay as f32,
        )
        .with_fused(fused);
        Self {
            vectors: matrices.with_weight_decay(0.0),
            matrices,
        }
    }
}

impl MatrixDecayAdamW {
    /// The AdamW of matrices and that of vectors (for optimizers that group parameters by
    /// kind, as ZeRO's flat buckets do).
    pub fn halves(&self) -> (FusedAdamW, FusedAdamW) {
        (self.matrices.clone(), self.vectors.clone())
    }
}

/// Its state is AdamW's, so checkpoints store and restore its moments as AdamW's.
impl<B: Backend> MomentState<B> for MatrixDecayAdamW {
    fn into_momentum<const D: usize>(state: AdamWState<B, D>) -> AdaptiveMomentumState<B, D> {
        state.momentum
    }
    fn from_momentum<const D: usize>(momentum: AdaptiveMomentumState<B, D>) -> AdamWState<B, D> {
        AdamWState { momentum }
    }
}

impl std::fmt::Debug for MatrixDecayAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MatrixDecayAdamW")
    }
}

impl<B: Backend> SimpleOptimizer<B> for MatrixDecayAdamW {
    type State<const D: usize> = AdamWState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let half = if D >= 2 {
            &self.matrices
        } else {
            &self.vectors
        };
        SimpleOptimizer::<B>::step(half, lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        <FusedAdamW as SimpleOptimizer<B>>::to_device(state, device)
    }
}

/// The recipe's optimizer type for model `M` on backend `B`.
pub type GptOptimizer<M, B> = OptimizerAdaptor<MatrixDecayAdamW, M, B>;

/// The optimizer of a run, with its data-parallel reduction (`wildfire_parallel::update`).
pub type Optimizers<B> = Update<B, GptOptimizer<GptChunks<B>, B>>;

/// The run's optimizer as burn-train's `Learner` holds it (see
/// `wildfire_parallel::learner_update`).
pub type LearnerOptimizer<B> = LearnerUpdate<B, GptOptimizer<GptChunks<B>, B>>;

/// Linear warmup to `lr` over `warmup` steps, then cosine decay to `min_lr` at `max_steps`:
///
/// ```text
/// lr(s) = lr · (s + 1) / warmup                                   s < warmup
/// lr(s) = min_lr + ½ (lr − min_lr) (1 + cos(π · (s − warmup) / (max_steps − warmup)))
/// ```
///
/// `s` counts optimizer steps from 0; past `max_steps` the rate stays at `min_lr`. Its only state
/// is the next step, which checkpoints store.
#[derive(Debug, Clone)]
pub struct WarmupCosine {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup: u64,
    pub max_steps: u64,
    pub next_step: u64,
}

impl WarmupCosine {
    pub fn new(train: &TrainSection) -> Self {
        Self {
            lr: train.lr,
            min_lr: train.min_lr,
            warmup: train.warmup_steps,
            max_steps: train.max_steps,
            next_step: 0,
        }
    }

    pub fn at(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.max_steps.saturating_sub(self.warmup).max(1);
        let progress = ((step - self.warmup) as f64 / span as f64).min(1.0);
        self.min_lr
            + 0.5 * (self.lr - self.min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

impl LrScheduler for WarmupCosine {
    type Record<B: Backend> = u64;

    fn step(&mut self) -> f64 {
        let lr = self.at(self.next_step);
        self.next_step += 1;
        lr
    }

    fn to_record<B: Backend>(&self) -> u64 {
        self.next_step
    }

    fn load_record<B: Backend>(mut self, record: u64) -> Self {
        self.next_step = record;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_linearly_then_decays_by_cosine_to_min_lr() {
        let schedule = WarmupCosine {
            lr: 1.0,
            min_lr: 0.1,
            warmup: 4,
            max_steps: 14,
            next_step: 0,
        };
        assert_eq!(schedule.at(0), 0.25);
        assert_eq!(schedule.at(3), 1.0);
        assert_eq!(schedule.at(4), 1.0);
        assert!(
            (schedule.at(9) - 0.55).abs() < 1e-12,
            "half way: {}",
            schedule.at(9)
        );
        assert!((schedule.at(14) - 0.1).abs() < 1e-12);
        assert!((schedule.at(100) - 0.1).abs() < 1e-12);
    }
}
