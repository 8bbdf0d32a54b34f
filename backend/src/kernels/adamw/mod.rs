//! AdamW's step as one pass over each parameter (what PyTorch's `fused=True` AdamW and Apex's
//! FusedAdam do), bit for bit Burn's AdamW.
//!
//! For a parameter `θ` with gradient `g`, moments `m, v` and step `t` (counting from 1), with
//! `η` the learning rate and `λ` the weight decay, Burn's AdamW computes, one tensor op at a
//! time:
//!
//! ```text
//! m ← β₁·m + (1 − β₁)·g          v ← β₂·v + (1 − β₂)·g²
//! δ = (m / (1 − β₁ᵗ)) / (√(v / (1 − β₂ᵗ)) + ε)
//! θ ← θ·(1 − η·λ) − η·δ          (no decay factor at all when η·λ = 0)
//! ```
//!
//! — about a dozen passes over the parameter's size, each a new tensor, and on Flex each on one
//! thread. [`FusedAdamW`] computes the same expression per element in one pass, in place and on
//! all threads, with the same f32 operations in the same order (and the same scalars, rounded
//! to f32 where Burn's scalar ops round them), so its results equal Burn's bit for bit: no
//! checkpoint, seed table or parallel-equals-serial check can tell them apart. Its state is
//! Burn's [`AdamWState`], so checkpoints are unchanged too.
//!
//! On Flex in f32, from the second step of a parameter on (the first creates the moments), the
//! pass runs natively. On Burn's CubeCL backends (wgpu, CUDA; bare or fused) it is one kernel
//! launch per parameter tensor, or per flat bucket under ZeRO ([`cube`]), with the same f32
//! operations in the same order, which a GPU may contract and round within a few ulps of
//! Burn's step rather than bit for bit. Otherwise (other backends, other dtypes,
//! `WILDFIRE_KERNELS=reference`, the fused step turned off) the step is Burn's AdamW itself.
//!
//! Like the model's fused ops ([`super::choice`]), the fused step is on by default where it was
//! verified: on the CPU and on wgpu, but not on CUDA until a GPU run has checked its kernel
//! ([`FusedAdamW::with_fused`] decides it either way).

use burn::optim::{AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::ops::Device;
use burn::tensor::{DType, Tensor};
use burn_flex::FlexTensor;
use rayon::prelude::*;

use super::choice::{FusedOp, FusedOps};
use super::route::{on_cube, on_flex_owned};
use super::{flex, tensor};
use crate::device::DeviceKind;

mod cube;

/// Elements per task of the native pass.
const TASK: usize = 1 << 14;

/// AdamW (Burn's, with decoupled weight decay; no AMSGrad, no cautious decay) whose step is one
/// fused pass on Flex; see the module doc.
#[derive(Clone)]
pub struct FusedAdamW {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    /// Whether the step runs fused: `None` as each device's default (on CPU and wgpu, off on
    /// CUDA: `FusedOps::device_default`), `Some` as set.
    fused: Option<bool>,
    /// Burn's AdamW with the same settings: the step wherever the pass does not run.
    reference: AdamW,
}

impl FusedAdamW {
    /// AdamW with the moments' decay rates `β₁ = beta_1`, `β₂ = beta_2`, `ε = epsilon` added to
    /// `√v̂`, and decoupled weight decay `λ = weight_decay` (as `AdamWConfig` names them).
    pub fn new(beta_1: f32, beta_2: f32, epsilon: f32, weight_decay: f32) -> Self {
        let reference = AdamWConfig::new()
            .with_beta_1(beta_1)
            .with_beta_2(beta_2)
            .with_epsilon(epsilon)
            .with_weight_decay(weight_decay)
            .build();
        Self {
            beta_1,
            beta_2,
            epsilon,
            weight_decay,
            fused: None,
            reference,
        }
    }

    /// The same optimizer with weight decay `weight_decay`.
    pub fn with_weight_decay(&self, weight_decay: f32) -> Self {
        Self {
            fused: self.fused,
            ..Self::new(self.beta_1, self.beta_2, self.epsilon, weight_decay)
        }
    }

    /// The same optimizer with its fused step on (`true`) or off (Burn's step everywhere), on
    /// every device, instead of each device's default.
    pub fn with_fused(self, fused: bool) -> Self {
        Self {
            fused: Some(fused),
            ..self
        }
    }

    /// Whether the fused step runs on a device of `kind`.
    fn fused_on(&self, kind: DeviceKind) -> bool {
        (self.fused).unwrap_or_else(|| FusedOps::device_default(kind).is_fused(FusedOp::Adamw))
    }

    /// The scalars of step `time` at learning rate `lr`, rounded as Burn's ops round them.
    fn scalars(&self, lr: f64, time: usize) -> StepScalars {
        let time = time as i32;
        let decay_rate = lr * self.weight_decay as f64;
        StepScalars {
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            gain_1: 1.0 - self.beta_1,
            gain_2: 1.0 - self.beta_2,
            correction_1: 1.0 - self.beta_1.powi(time),
            correction_2: 1.0 - self.beta_2.powi(time),
            epsilon: self.epsilon,
            keep: (decay_rate != 0.0).then_some((1.0 - decay_rate) as f32),
            lr: lr as f32,
        }
    }
}

impl std::fmt::Debug for FusedAdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedAdamW")
            .field("beta_1", &self.beta_1)
            .field("beta_2", &self.beta_2)
            .field("epsilon", &self.epsilon)
            .field("weight_decay", &self.weight_decay)
            .field("fused", &self.fused)
            .finish()
    }
}

impl<B: Backend> SimpleOptimizer<B> for FusedAdamW {
    type State<const D: usize> = AdamWState<B, D>;

    // The launch's error is its four inputs handed back, moved once a call.
    #[allow(clippy::result_large_err)]
    fn step<const D: usize>(
        &self,
        lr: f64,
        param: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let Some(AdamWState { momentum }) = state else {
            return SimpleOptimizer::<B>::step(&self.reference, lr, param, grad, None);
        };
        if self.fused == Some(false) {
            let state = Some(AdamWState { momentum });
            return SimpleOptimizer::<B>::step(&self.reference, lr, param, grad, state);
        }
        let time = momentum.time + 1;
        let scalars = self.scalars(lr, time);
        let inputs = [param, grad, momentum.moment_1, momentum.moment_2]
            .map(|t| t.into_primitive().tensor());
        let kernel = cube::Step {
            scalars,
            on_cuda: self.fused_on(DeviceKind::Cuda),
        };
        let stepped = on_cube(&kernel, inputs).or_else(|inputs| {
            on_flex_owned("adamw", inputs, |inputs| step_in_place(inputs, &scalars))
        });
        match stepped {
            Ok([param, moment_1, moment_2]) => {
                let momentum = AdaptiveMomentumState {
                    time,
                    moment_1: tensor(moment_1),
                    moment_2: tensor(moment_2),
                    max_moment_2: None,
                };
                (tensor(param), Some(AdamWState { momentum }))
            }
            Err([param, grad, moment_1, moment_2]) => {
                let momentum = AdaptiveMomentumState {
                    moment_1: tensor(moment_1),
                    moment_2: tensor(moment_2),
                    ..momentum
                };
                let state = Some(AdamWState { momentum });
                SimpleOptimizer::<B>::step(&self.reference, lr, tensor(param), tensor(grad), state)
            }
        }
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device<B>) -> Self::State<D> {
        <AdamW as SimpleOptimizer<B>>::to_device(state, device)
    }
}

/// One step's scalars, in f32 as Burn's scalar ops apply them.
#[derive(Debug, Clone, Copy)]
struct StepScalars {
    beta_1: f32,
    beta_2: f32,
    /// `1 − β₁`, `1 − β₂`.
    gain_1: f32,
    gain_2: f32,
    /// `1 − β₁ᵗ`, `1 − β₂ᵗ`.
    correction_1: f32,
    correction_2: f32,
    epsilon: f32,
    /// `1 − η·λ` (in f64, then rounded), or `None` when `η·λ = 0`.
    keep: Option<f32>,
    lr: f32,
}

impl StepScalars {
    /// The step on one element: `(θ, m, v)` after it. Each line is one of Burn's tensor ops,
    /// in its order (no operation is fused into another, so every rounding is the same).
    #[inline(always)]
    fn apply(&self, param: f32, grad: f32, moment_1: f32, moment_2: f32) -> (f32, f32, f32) {
        let moment_1 = moment_1 * self.beta_1 + grad * self.gain_1;
        let moment_2 = moment_2 * self.beta_2 + (grad * grad) * self.gain_2;
        let corrected_1 = moment_1 / self.correction_1;
        let corrected_2 = moment_2 / self.correction_2;
        let delta = corrected_1 / (corrected_2.sqrt() + self.epsilon);
        let decayed = match self.keep {
            Some(keep) => param * keep,
            None => param,
        };
        (decayed - delta * self.lr, moment_1, moment_2)
    }
}

/// `[θ, m, v]` after one step from `[θ, g, m, v]`, all f32 of one shape; the inputs back
/// otherwise. `θ`, `m` and `v` are updated in their own memory when nothing else holds it
/// (Flex copies it first when something does).
#[allow(clippy::result_large_err)] // the inputs handed back, moved once a call
fn step_in_place(
    inputs: [FlexTensor; 4],
    scalars: &StepScalars,
) -> Result<[FlexTensor; 3], [FlexTensor; 4]> {
    let shape = inputs[0].layout().shape().clone();
    let takes = inputs
        .iter()
        .all(|t| *t.layout().shape() == shape && t.dtype() == DType::F32);
    if !takes {
        return Err(inputs);
    }
    let [mut param, grad, mut moment_1, mut moment_2] = inputs.map(flex::contiguous);
    let grad = grad.as_slice::<f32>().expect("contiguous f32");
    let [param_values, moment_1_values, moment_2_values] =
        [&mut param, &mut moment_1, &mut moment_2].map(flex::elements_mut);
    param_values
        .par_chunks_mut(TASK)
        .zip(moment_1_values.par_chunks_mut(TASK))
        .zip(moment_2_values.par_chunks_mut(TASK))
        .zip(grad.par_chunks(TASK))
        .for_each(|(((param, moment_1), moment_2), grad)| {
            flex::vectorised(
                #[inline(always)]
                || {
                    for (((p, m), v), g) in param.iter_mut().zip(moment_1).zip(moment_2).zip(grad) {
                        (*p, *m, *v) = scalars.apply(*p, *g, *m, *v);
                    }
                },
            )
        });
    Ok([param, moment_1, moment_2])
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::{Distribution, TensorData};

    use super::*;
    use crate::Parallel;

    fn bits<B: Backend, const D: usize>(t: &Tensor<B, D>) -> Vec<u32> {
        let values: Vec<f32> = t.to_data().to_vec().unwrap();
        values.into_iter().map(f32::to_bits).collect()
    }

    /// Steps `param` with `optimizer`, one step per gradient of `grads`, at a learning rate
    /// that changes each step; the bits of the parameter and the moments after each step.
    fn run<B: Backend, O: SimpleOptimizer<B, State<2> = AdamWState<B, 2>>>(
        optimizer: &O,
        mut param: Tensor<B, 2>,
        grads: &[Tensor<B, 2>],
    ) -> Vec<[Vec<u32>; 3]> {
        let mut state = None;
        let mut seen = Vec::new();
        for (step, grad) in grads.iter().enumerate() {
            let lr = 1e-3 * (1.0 + step as f64 / 3.0);
            let (next, next_state) = optimizer.step(lr, param, grad.clone(), state);
            let momentum = &next_state.as_ref().unwrap().momentum;
            seen.push([
                bits(&next),
                bits(&momentum.moment_1),
                bits(&momentum.moment_2),
            ]);
            (param, state) = (next, next_state);
        }
        seen
    }

    /// Parameters and moments equal Burn's AdamW's bit for bit over several steps,
    /// with and without weight decay, on `Parallel<Flex>` and on bare Flex, for a size that
    /// spans several tasks and one that does not, including zero and huge gradients.
    #[test]
    fn equals_burn_adamw_bit_for_bit() {
        let device = Default::default();
        for weight_decay in [0.0, 0.1] {
            for len in [7, 3 * TASK + 5] {
                let fused = FusedAdamW::new(0.9, 0.95, 1e-8, weight_decay);
                let burn = fused.reference.clone();
                let param = Tensor::<Flex, 2>::random([len, 1], Distribution::Default, &device);
                let mut grads: Vec<Tensor<Flex, 2>> = (0..4)
                    .map(|_| Tensor::random([len, 1], Distribution::Normal(0.0, 1.0), &device))
                    .collect();
                let mut extremes = vec![0.0f32; len];
                extremes[0] = 1e30;
                extremes[len - 1] = -1e-30;
                grads.push(Tensor::from_data(
                    TensorData::new(extremes, [len, 1]),
                    &device,
                ));
                let what = format!("len {len}, weight decay {weight_decay}");
                let expected = run(&burn, param.clone(), &grads);
                assert_eq!(run(&fused, param.clone(), &grads), expected, "Flex, {what}");
                let lift = |t: &Tensor<Flex, 2>| {
                    Tensor::<Parallel<Flex>, 2>::from_data(t.to_data(), &device)
                };
                let grads: Vec<_> = grads.iter().map(lift).collect();
                assert_eq!(
                    run(&fused, lift(&param), &grads),
                    expected,
                    "Parallel<Flex>, {what}"
                );
            }
        }
    }

    /// A parameter another tensor shares is not written through: the other keeps its values.
    #[test]
    fn leaves_shared_memory_alone() {
        let device = Default::default();
        let fused = FusedAdamW::new(0.9, 0.999, 1e-8, 0.1);
        let param = Tensor::<Flex, 1>::from_floats([1.0, 2.0, 3.0], &device);
        let grad = Tensor::<Flex, 1>::from_floats([0.5, -0.5, 1.0], &device);
        let (param, state) = SimpleOptimizer::<Flex>::step(&fused, 0.1, param, grad.clone(), None);
        let kept = param.clone();
        let before = bits(&kept);
        let (stepped, _) = SimpleOptimizer::<Flex>::step(&fused, 0.1, param, grad, state);
        assert_eq!(bits(&kept), before, "the shared parameter changed");
        assert_ne!(bits(&stepped), before, "the step did nothing");
    }

    /// A parameter and moments that nothing else holds are updated in their own memory: no
    /// copy, no new allocation.
    #[test]
    fn updates_unshared_memory_in_place() {
        let device = Default::default();
        let fused = FusedAdamW::new(0.9, 0.999, 1e-8, 0.1);
        let param = Tensor::<Parallel<Flex>, 1>::from_floats([1.0, 2.0, 3.0], &device);
        let grad = Tensor::<Parallel<Flex>, 1>::from_floats([0.5, -0.5, 1.0], &device);
        let step = |param, state| SimpleOptimizer::step(&fused, 0.1, param, grad.clone(), state);
        let (param, state) = step(param, None);
        let address = |t: &Tensor<Parallel<Flex>, 1>| {
            t.clone().into_primitive().tensor().bytes().as_ptr() as usize
        };
        let memory = |param: &Tensor<Parallel<Flex>, 1>, state: &Option<AdamWState<_, 1>>| {
            let momentum = &state.as_ref().expect("a state").momentum;
            [param, &momentum.moment_1, &momentum.moment_2].map(address)
        };
        let before = memory(&param, &state);
        let (param, state) = step(param, state);
        assert_eq!(
            memory(&param, &state),
            before,
            "θ, m, v moved to new memory"
        );
    }

    /// Other dtypes take Burn's step.
    #[test]
    fn half_precision_takes_burns_step() {
        let device = Default::default();
        let fused = FusedAdamW::new(0.9, 0.999, 1e-8, 0.0);
        let param = Tensor::<Flex, 1>::from_floats([1.0, 2.0], &device).cast(DType::F16);
        let grad = Tensor::<Flex, 1>::from_floats([0.5, -0.5], &device).cast(DType::F16);
        let burn = fused.reference.clone();
        let (_, state) =
            SimpleOptimizer::<Flex>::step(&fused, 0.1, param.clone(), grad.clone(), None);
        let (_, burn_state) =
            SimpleOptimizer::<Flex>::step(&burn, 0.1, param.clone(), grad.clone(), None);
        let (got, _) =
            SimpleOptimizer::<Flex>::step(&fused, 0.1, param.clone(), grad.clone(), state);
        let (expected, _) = SimpleOptimizer::<Flex>::step(&burn, 0.1, param, grad, burn_state);
        assert_eq!(got.dtype(), DType::F16);
        assert_eq!(got.into_data(), expected.into_data());
    }
}
