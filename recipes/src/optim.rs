//! The optimizer side of the recipe: AdamW with weight decay on matrices only, the warmup +
//! cosine learning-rate schedule, and global gradient-norm clipping.

use std::sync::{Arc, Mutex, MutexGuard};

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::{AdamWState, GradientsParams, Optimizer, SimpleOptimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor};
use wildfire_backend::kernels::adamw::FusedAdamW;

use crate::config::TrainSection;

/// AdamW that decays only tensors of rank ≥ 2 (weight matrices and embeddings), never biases or
/// LayerNorm gains, as GPT-2 reproductions do. Both halves share Burn's AdamW update
/// `θ ← θ(1 − η·λ) − η·m̂/(√v̂ + ε)`, run as one fused pass per parameter
/// ([`FusedAdamW`], bit for bit Burn's); only λ differs.
#[derive(Clone)]
pub struct MatrixDecayAdamW {
    matrices: FusedAdamW,
    vectors: FusedAdamW,
}

impl MatrixDecayAdamW {
    pub fn new(train: &TrainSection) -> Self {
        let matrices = FusedAdamW::new(
            train.beta1 as f32,
            train.beta2 as f32,
            train.eps as f32,
            train.weight_decay as f32,
        );
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

/// An optimizer whose state can be read while burn-train's `Learner` owns it: clones share one
/// state. The training loop keeps a handle to save and restore the moments in checkpoints.
#[derive(Debug)]
pub struct SharedOptimizer<O>(Arc<Mutex<O>>);

impl<O> Clone for SharedOptimizer<O> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<O> SharedOptimizer<O> {
    pub fn new(optimizer: O) -> Self {
        Self(Arc::new(Mutex::new(optimizer)))
    }

    pub fn lock(&self) -> MutexGuard<'_, O> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl<O, M, B> Optimizer<M, B> for SharedOptimizer<O>
where
    O: Optimizer<M, B>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    type Record = O::Record;

    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        self.lock().step(lr, module, grads)
    }

    fn step_multi(&mut self, lr: f64, module: M, grads: burn::optim::MultiGradientsParams) -> M {
        self.lock().step_multi(lr, module, grads)
    }

    fn to_record(&self) -> Self::Record {
        self.lock().to_record()
    }

    fn load_record(self, record: Self::Record) -> Self {
        {
            let mut inner = self.lock();
            let current = inner.clone();
            *inner = current.load_record(record);
        }
        self
    }
}

/// The recipe's optimizer type for model `M` on backend `B`.
pub type GptOptimizer<M, B> = SharedOptimizer<OptimizerAdaptor<MatrixDecayAdamW, M, B>>;

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

/// Visits every float parameter that has a gradient, in module order.
struct GradVisitor<'a, F> {
    grads: &'a GradientsParams,
    each: F,
}

impl<B, F> ModuleVisitor<B> for GradVisitor<'_, F>
where
    B: AutodiffBackend,
    F: FnMut(ParamId, f64),
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let squares = grad.square().sum().into_scalar().elem::<f64>();
            (self.each)(param.id, squares);
        }
    }
}

/// Σ‖g_p‖² over the parameters of `module` that have gradients, each term reduced by the backend
/// and summed here in f64, in module order (so the value is deterministic).
pub fn grad_sum_of_squares<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
) -> f64 {
    grad_sum_of_squares_except(module, grads, &[])
}

/// [`grad_sum_of_squares`] without the parameters `skip` (e.g. a copy of a parameter that
/// another rank counts).
pub fn grad_sum_of_squares_except<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
    skip: &[ParamId],
) -> f64 {
    let mut total = 0.0;
    module.visit(&mut GradVisitor {
        grads,
        each: |id, squares| {
            if !skip.contains(&id) {
                total += squares;
            }
        },
    });
    total
}

/// Global gradient-norm clipping as `torch.nn.utils.clip_grad_norm_` defines it:
/// `n = √(Σ_p ‖g_p‖²)`, and every gradient is scaled by `c = max_norm / (n + 10⁻⁶)` when `c < 1`. Returns `n`, the norm before clipping. `max_norm = 0` only measures.
///
/// Burn's own `GradientClipping::Norm` bounds each tensor's norm separately, which is a different
/// (and model-size dependent) rule.
pub fn clip_global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> f64 {
    let squares = grad_sum_of_squares(module, grads);
    clip_to_norm(module, grads, max_norm, squares)
}

/// [`clip_global_norm`] when the model is spread over ranks: `sum_of_squares` is `Σ_p ‖g_p‖²`
/// over the *whole* model (every rank's share, each parameter counted once), and `module` and
/// `grads` are this rank's part. Returns the global norm.
pub fn clip_to_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
    sum_of_squares: f64,
) -> f64 {
    let norm = sum_of_squares.sqrt();
    if let Some(factor) = clip_factor(norm, max_norm) {
        scale_grads(module, grads, factor);
    }
    norm
}

/// The factor `c = max_norm / (norm + 10⁻⁶)` that clips a gradient of norm `norm`, when
/// clipping is on (`max_norm > 0`) and `c < 1`.
pub fn clip_factor(norm: f64, max_norm: f64) -> Option<f64> {
    let factor = max_norm / (norm + 1e-6);
    (max_norm > 0.0 && factor < 1.0).then_some(factor)
}

/// Multiplies every gradient of `module` by `factor`.
pub fn scale_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    factor: f64,
) {
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f64,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                self.grads.register(param.id, grad.mul_scalar(self.factor));
            }
        }
    }
    module.visit(&mut Scale { grads, factor });
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};
    use burn::nn::LinearConfig;
    use burn::tensor::TensorData;

    use super::*;

    type B = Autodiff<Flex>;

    /// `L = Σ(xW + b)` for `x = [[1, 2], [3, 4]]` has `∂L/∂W = [[4, 4, 4], [6, 6, 6]]` (column
    /// sums of x, per output) and `∂L/∂b = [2, 2, 2]`, so the global norm is √(3·16 + 3·36 + 3·4)
    /// = √168, and clipping to 1 scales both by 1/(√168 + 10⁻⁶).
    #[test]
    fn global_clipping_matches_the_hand_computation() {
        let device = Default::default();
        let linear = LinearConfig::new(2, 3).init::<B>(&device);
        let x = Tensor::<B, 2>::from_data(TensorData::from([[1.0f32, 2.0], [3.0, 4.0]]), &device);
        let grads = linear.forward(x).sum().backward();
        let mut grads = GradientsParams::from_grads(grads, &linear);
        let norm = clip_global_norm(&linear, &mut grads, 1.0);
        assert!((norm - 168f64.sqrt()).abs() < 1e-5, "norm {norm}");
        let scale = (1.0 / (168f64.sqrt() + 1e-6)) as f32;
        let weight = grads.get::<Flex, 2>(linear.weight.id).unwrap().into_data();
        let bias = grads
            .get::<Flex, 1>(linear.bias.as_ref().unwrap().id)
            .unwrap()
            .into_data();
        weight.assert_approx_eq::<f32>(
            &TensorData::from([[4.0 * scale; 3], [6.0 * scale; 3]]),
            burn::tensor::Tolerance::absolute(1e-6),
        );
        bias.assert_approx_eq::<f32>(
            &TensorData::from([2.0 * scale; 3]),
            burn::tensor::Tolerance::absolute(1e-6),
        );
        let clipped = grad_sum_of_squares(&linear, &grads).sqrt();
        assert!(
            (clipped - 1.0).abs() < 1e-5,
            "norm after clipping {clipped}"
        );
    }

    #[test]
    fn norms_below_the_bound_are_left_alone() {
        let device = Default::default();
        let linear = LinearConfig::new(2, 3).init::<B>(&device);
        let x = Tensor::<B, 2>::from_data(TensorData::from([[1.0f32, 2.0], [3.0, 4.0]]), &device);
        let mut grads = GradientsParams::from_grads(linear.forward(x).sum().backward(), &linear);
        let norm = clip_global_norm(&linear, &mut grads, 100.0);
        assert!((norm - 168f64.sqrt()).abs() < 1e-5);
        let bias = grads
            .get::<Flex, 1>(linear.bias.as_ref().unwrap().id)
            .unwrap()
            .into_data();
        assert_eq!(bias, TensorData::from([2.0f32; 3]));
    }

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
