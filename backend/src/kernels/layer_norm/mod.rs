//! Fused LayerNorm and RMSNorm with their fused backward (what Apex's and Megatron-LM's fused
//! norms do): one pass over the rows each way, keeping only the input for the backward.
//!
//! For a row `x` of `n` values (the rows of `x: [.., n]` are all its indices but the last), with
//! `γ, β: [n]` broadcast over the rows and everything computed in f32:
//!
//! ```text
//! μ = Σ x / n        σ² = Σ (x − μ)² / n        r = 1 / √(σ² + ε)        x̂ = (x − μ)·r
//! y = x̂ ∘ γ + β
//! ```
//!
//! The variance is taken around the mean (two passes over the row), not as `Σx²/n − μ²`, which
//! cancels catastrophically when the mean is large against the spread. **Backward**, given `dy`,
//! with `g = dy ∘ γ` and row means `⟨·⟩`:
//!
//! ```text
//! dx = r·(g − ⟨g⟩ − x̂ ∘ ⟨g ∘ x̂⟩)        dγ = Σ_rows dy ∘ x̂        dβ = Σ_rows dy
//! ```
//!
//! (`x̂` depends on `x` through `μ` and `r`: `∂x̂ⱼ/∂xᵢ = r(δᵢⱼ − 1/n − x̂ᵢx̂ⱼ/n)`.) The backward
//! recomputes `μ` and `r` from `x`, so the autodiff node needs `x` and `γ` only; Burn's
//! composed LayerNorm keeps about four tensors of `x`'s size and runs some twenty elementwise
//! passes and reductions, each on one thread on Flex.
//!
//! **RMSNorm** (Llama's) is the same op uncentred: `μ` is taken as 0 and there is no `β`, so
//! `r = 1/√(⟨x²⟩ + ε)`, `x̂ = x·r`, `y = x̂ ∘ γ`, and as `∂x̂ⱼ/∂xᵢ = r(δᵢⱼ − x̂ᵢx̂ⱼ/n)` the
//! backward drops the `⟨g⟩` term: `dx = r·(g − x̂ ∘ ⟨g ∘ x̂⟩)`, `dγ = Σ_rows dy ∘ x̂`.
//!
//! `x` in f32, f16 or bf16 comes back in its type; `γ` and `β` may be in any float type. On
//! CubeCL backends the passes are the kernels of [`cube`] (one cube per row, sums over shared
//! memory); on Flex in f32 the loops of [`flex`] (rows in parallel); elsewhere the reference in
//! Burn ops.

use std::marker::PhantomData;

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Tensor, TensorMetadata};

use super::cube_kernel::CubeKernel;
use super::route::{on_cube, on_flex, took_reference};
use super::{as_rows, cast_primitive, in_dtype, tensor};
use crate::Parallel;

pub mod cube;
pub mod flex;

/// A backend with the fused LayerNorm (`centred`) or RMSNorm (see the module doc) on
/// `x: [.., n]` with `γ, β: [n]`, whose autodiff backward is the fused one.
pub trait FusedLayerNormBackend: Backend {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        centred: bool,
    ) -> FloatTensor<Self>;
}

/// `x̂ ∘ γ + β` over the rows of `x: [.., n]` (any rank), in `x`'s type (see the module doc); no
/// `β` adds nothing (and computes no gradient for it).
///
/// # Panics
/// When `γ` or `β` is not `[n]`, naming the shapes.
pub fn layer_norm<B: FusedLayerNormBackend, const D: usize>(
    x: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    beta: Option<Tensor<B, 1>>,
    epsilon: f64,
) -> Tensor<B, D> {
    norm(x, gamma, beta, epsilon, true)
}

/// RMSNorm's `x̂ ∘ γ` over the rows of `x: [.., n]` (any rank), in `x`'s type (see the module
/// doc).
///
/// # Panics
/// When `γ` is not `[n]`, naming the shapes.
pub fn rms_norm<B: FusedLayerNormBackend, const D: usize>(
    x: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    epsilon: f64,
) -> Tensor<B, D> {
    norm(x, gamma, None, epsilon, false)
}

/// LayerNorm (`centred`) or RMSNorm.
fn norm<B: FusedLayerNormBackend, const D: usize>(
    x: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    beta: Option<Tensor<B, 1>>,
    epsilon: f64,
    centred: bool,
) -> Tensor<B, D> {
    let shape = x.dims();
    let columns = shape[D - 1];
    let beta = beta.unwrap_or_else(|| gamma.zeros_like());
    for (name, parameter) in [("gamma", &gamma), ("beta", &beta)] {
        assert_eq!(
            parameter.dims(),
            [columns],
            "layer_norm: {name} {:?} for input {shape:?} (one value per column)",
            parameter.dims()
        );
    }
    let [x, gamma, beta] = [
        x.into_primitive().tensor(),
        primitive(gamma),
        primitive(beta),
    ];
    tensor(B::fused_layer_norm(x, gamma, beta, epsilon, centred))
}

fn primitive<B: Backend>(t: Tensor<B, 1>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// `(x̂, r)` of the rows of `x: [rows, n]`, in f32: the normalised rows and each row's `r`
/// (`[rows, 1]`); uncentred for RMSNorm.
fn normalised<B: Backend>(
    x: Tensor<B, 2>,
    epsilon: f64,
    centred: bool,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let x = in_dtype(x, FloatDType::F32);
    let centred = match centred {
        true => x.clone() - x.mean_dim(1),
        false => x,
    };
    let variance = (centred.clone() * centred.clone()).mean_dim(1);
    let r = (variance + epsilon).sqrt().recip();
    (centred * r.clone(), r)
}

/// A parameter `[n]` in f32, as a row `[1, n]` to broadcast.
fn row<B: Backend>(parameter: Tensor<B, 1>) -> Tensor<B, 2> {
    in_dtype(parameter, FloatDType::F32).unsqueeze()
}

/// The reference forward: `x̂ ∘ γ + β` in f32 with Burn ops, returned in `x`'s type.
pub fn reference_forward<B: Backend>(
    x: Tensor<B, 2>,
    gamma: Tensor<B, 1>,
    beta: Tensor<B, 1>,
    epsilon: f64,
    centred: bool,
) -> Tensor<B, 2> {
    let dtype = FloatDType::from(x.dtype());
    let (normalised, _) = normalised(x, epsilon, centred);
    in_dtype(normalised * row(gamma) + row(beta), dtype)
}

/// The gradients of the three inputs, in f32: `x`'s (`[rows, n]`), `γ`'s and `β`'s (`[n]`).
#[derive(Debug, Clone)]
pub struct LayerNormGrads<B: Backend> {
    pub x: Tensor<B, 2>,
    pub gamma: Tensor<B, 1>,
    pub beta: Tensor<B, 1>,
}

/// The reference backward (see the module doc) in f32 with Burn ops.
pub fn reference_backward<B: Backend>(
    x: Tensor<B, 2>,
    gamma: Tensor<B, 1>,
    output_grad: Tensor<B, 2>,
    epsilon: f64,
    centred: bool,
) -> LayerNormGrads<B> {
    let columns = x.dims()[1];
    let (normalised, r) = normalised(x, epsilon, centred);
    let output_grad = in_dtype(output_grad, FloatDType::F32);
    let g = output_grad.clone() * row(gamma);
    let g_normalised_mean = (g.clone() * normalised.clone()).mean_dim(1);
    let g = match centred {
        true => g.clone() - g.mean_dim(1),
        false => g,
    };
    let x_grad = (g - normalised.clone() * g_normalised_mean) * r;
    let column_sum = |t: Tensor<B, 2>| t.sum_dim(0).reshape([columns]);
    LayerNormGrads {
        x: x_grad,
        gamma: column_sum(output_grad.clone() * normalised),
        beta: column_sum(output_grad),
    }
}

/// The forward on backend `B`: the CubeCL kernel or the native loops on Flex (unless opted
/// out), the reference otherwise.
fn forward_on<B: Backend>(
    inputs: [FloatTensor<B>; 3],
    epsilon: f64,
    centred: bool,
) -> FloatTensor<B> {
    let kernel = cube::Forward { epsilon, centred };
    match on_cube(&kernel, inputs).or_else(|inputs| {
        on_flex(kernel.op(), inputs, |inputs| {
            flex::layer_norm_forward(inputs, epsilon, centred)
        })
    }) {
        Ok([y]) => y,
        Err([x, gamma, beta]) => {
            took_reference(kernel.op());
            let shape = x.shape();
            let (gamma, beta) = (tensor(gamma), tensor(beta));
            let y = reference_forward::<B>(as_rows(x), gamma, beta, epsilon, centred);
            B::float_reshape(y.into_primitive().tensor(), shape)
        }
    }
}

/// `[dx, dγ, dβ]` on backend `B` from `[x, γ, dy]`, in f32 (`dx` from the CubeCL kernels in
/// `x`'s type): the CubeCL kernels or the native loops on Flex (unless opted out), the
/// reference otherwise.
fn backward_on<B: Backend>(
    inputs: [FloatTensor<B>; 3],
    epsilon: f64,
    centred: bool,
) -> [FloatTensor<B>; 3] {
    let kernel = cube::Backward { epsilon, centred };
    match on_cube(&kernel, inputs).or_else(|inputs| {
        on_flex(kernel.op(), inputs, |inputs| {
            flex::layer_norm_backward(inputs, epsilon, centred)
        })
    }) {
        Ok(grads) => grads,
        Err([x, gamma, output_grad]) => {
            took_reference(kernel.op());
            let shape = x.shape();
            let (x, gamma, dy) = (as_rows(x), tensor(gamma), as_rows(output_grad));
            let grads = reference_backward::<B>(x, gamma, dy, epsilon, centred);
            [
                B::float_reshape(grads.x.into_primitive().tensor(), shape),
                primitive(grads.gamma),
                primitive(grads.beta),
            ]
        }
    }
}

impl<B: Backend> FusedLayerNormBackend for Parallel<B> {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        centred: bool,
    ) -> FloatTensor<Self> {
        forward_on::<Self>([x, gamma, beta], epsilon, centred)
    }
}

/// The autodiff node of the fused LayerNorm. Memory-bound for the checkpointing strategies:
/// under Burn's balanced checkpointing its output is recomputed in the backward
/// ([`RetroLayerNorm`]) rather than kept, like the elementwise ops of Burn's composed
/// LayerNorm; its state is the ids of `x` and `γ`, whose values the checkpointer keeps.
#[derive(Debug)]
struct LayerNormBackward {
    epsilon: f64,
    centred: bool,
    beta_dtype: DType,
}

impl<B: Backend> Backward<Parallel<B>, 3> for LayerNormBackward {
    type State = [NodeId; 2];

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let output_grad = grads.consume::<Parallel<B>>(&ops.node);
        let [x, gamma] = ops
            .state
            .map(|id| checkpointer.retrieve_node_output::<FloatTensor<Parallel<B>>>(id));
        let dtypes = [x.dtype(), gamma.dtype(), self.beta_dtype];
        let inputs = [x, gamma, output_grad];
        let input_grads = backward_on::<Parallel<B>>(inputs, self.epsilon, self.centred);
        for ((node, grad), dtype) in ops.parents.into_iter().zip(input_grads).zip(dtypes) {
            if let Some(node) = node {
                grads.register::<Parallel<B>>(
                    node.id,
                    cast_primitive::<Parallel<B>>(grad, FloatDType::from(dtype)),
                );
            }
        }
    }
}

/// The forward again, from the inputs `[x, γ, β]` (by node id), for a checkpointed backward.
#[derive(Debug)]
struct RetroLayerNorm<B> {
    inputs: [NodeId; 3],
    epsilon: f64,
    centred: bool,
    backend: PhantomData<B>,
}

impl<B: Backend> RetroForward for RetroLayerNorm<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let inputs = self
            .inputs
            .map(|id| states.get_state::<FloatTensor<Parallel<B>>>(&id));
        let y = forward_on::<Parallel<B>>(inputs, self.epsilon, self.centred);
        states.save(out_node, y)
    }
}

impl<B: Backend, C: CheckpointStrategy> FusedLayerNormBackend for Autodiff<Parallel<B>, C> {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        centred: bool,
    ) -> FloatTensor<Self> {
        let inputs = [&x, &gamma, &beta];
        let node = LayerNormBackward {
            epsilon,
            centred,
            beta_dtype: beta.primitive.dtype(),
        };
        let retro = RetroLayerNorm::<B> {
            inputs: inputs.map(|input| input.node.id),
            epsilon,
            centred,
            backend: PhantomData,
        };
        let prepared = node
            .prepare::<C>(inputs.map(|input| input.node.clone()))
            .memory_bound()
            .retro_forward(retro)
            .parents(inputs)
            .stateful();
        let primitives = inputs.map(|input| input.primitive.clone());
        let y = forward_on::<Parallel<B>>(primitives, epsilon, centred);
        match prepared {
            OpsKind::Tracked(mut prep) => {
                let state = [prep.checkpoint(&x), prep.checkpoint(&gamma)];
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};
    use burn::module::Param;
    use burn::nn::{LayerNorm, LayerNormConfig, RmsNorm, RmsNormConfig};
    use burn::tensor::Distribution;

    use super::*;

    /// Burn's own LayerNorm under autodiff, the independent reference.
    type Burn = Autodiff<Flex>;
    /// The fused op under autodiff (Flex's loops, unless `WILDFIRE_KERNELS=reference`).
    type Fused = Autodiff<Parallel<Flex>>;

    const EPSILON: f64 = 1e-5;

    fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    fn max_difference(a: &[f32], b: &[f32]) -> f32 {
        crate::compare::max_abs_difference(a, b) as f32
    }

    /// `[output, dx, dγ, dβ]` of `Σ y ∘ dy` through `norm` on backend `B`.
    fn run<B: burn::tensor::backend::AutodiffBackend>(
        inputs: &[Vec<f32>; 4],
        shape: [usize; 2],
        norm: impl Fn(Tensor<B, 2>, Tensor<B, 1>, Tensor<B, 1>) -> Tensor<B, 2>,
    ) -> [Vec<f32>; 4] {
        let device = Default::default();
        let matrix =
            |v: &Vec<f32>| Tensor::<B, 1>::from_floats(v.as_slice(), &device).reshape(shape);
        let vector = |v: &Vec<f32>| Tensor::<B, 1>::from_floats(v.as_slice(), &device);
        let [x, gamma, beta, output_grad] = inputs;
        let (x, gamma, beta) = (
            matrix(x).require_grad(),
            vector(gamma).require_grad(),
            vector(beta).require_grad(),
        );
        let y = norm(x.clone(), gamma.clone(), beta.clone());
        let grads = (y.clone() * matrix(output_grad)).sum().backward();
        let grad = |t: Tensor<B, 1>| values(t.grad(&grads).unwrap());
        [
            values(y),
            values(x.grad(&grads).unwrap()),
            grad(gamma),
            grad(beta),
        ]
    }

    /// The fused op, and its reference in Burn ops, against Burn's own LayerNorm under
    /// autodiff: the output and the gradients of `x`, `γ` and `β`, on rows of mean 0.5, widths
    /// 1, 7, 128 and 200 (not a multiple of the SIMD lanes). f32 tolerances: 2e-5 on the output
    /// and `dx` (values of order 1; the orders of summation differ by a few ulps per row of up
    /// to 200 terms), 1e-4 on `dγ` and `dβ` (sums over 60 rows of such values).
    #[test]
    fn fused_layer_norm_matches_burns_layer_norm() {
        assert_matches_burn(true);
    }

    /// The same for RMSNorm against Burn's own `RmsNorm` (which has no `β`: its gradient is 0
    /// on both sides), with the same tolerances.
    #[test]
    fn fused_rms_norm_matches_burns_rms_norm() {
        assert_matches_burn(false);
    }

    /// Burn's LayerNorm (`centred`) or RMSNorm of `x` with `γ` and `β` (RMSNorm ignores `β`).
    fn burns_norm(
        x: Tensor<Burn, 2>,
        gamma: Tensor<Burn, 1>,
        beta: Tensor<Burn, 1>,
        centred: bool,
    ) -> Tensor<Burn, 2> {
        let device = x.device();
        let columns = x.dims()[1];
        if centred {
            let mut norm: LayerNorm<Burn> = LayerNormConfig::new(columns)
                .with_epsilon(EPSILON)
                .init(&device);
            norm.gamma = Param::from_tensor(gamma);
            norm.beta = Some(Param::from_tensor(beta));
            return norm.forward(x);
        }
        let mut norm: RmsNorm<Burn> = RmsNormConfig::new(columns)
            .with_epsilon(EPSILON)
            .init(&device);
        norm.gamma = Param::from_tensor(gamma);
        norm.forward(x) + (beta * 0.0).unsqueeze()
    }

    fn assert_matches_burn(centred: bool) {
        let device = Default::default();
        for columns in [1, 7, 128, 200] {
            Flex::seed(&device, columns as u64);
            let shape = [60, columns];
            let draw = |len: usize, mean: f64| {
                values(Tensor::<Flex, 1>::random(
                    [len],
                    Distribution::Normal(mean, 1.0),
                    &device,
                ))
            };
            let inputs = [
                draw(60 * columns, 0.5),
                draw(columns, 1.0),
                draw(columns, 0.0),
                draw(60 * columns, 0.0),
            ];
            let expected = run::<Burn>(&inputs, shape, |x, gamma, beta| {
                burns_norm(x, gamma, beta, centred)
            });
            let fused = run::<Fused>(&inputs, shape, |x, gamma, beta| match centred {
                true => layer_norm(x, gamma, Some(beta), EPSILON),
                false => rms_norm(x, gamma, EPSILON) + (beta * 0.0).unsqueeze(),
            });
            let vector = |v: &Vec<f32>| Tensor::<Flex, 1>::from_floats(v.as_slice(), &device);
            let matrix = |v: &Vec<f32>| vector(v).reshape(shape);
            let (x, gamma, beta, output_grad) = (
                matrix(&inputs[0]),
                vector(&inputs[1]),
                vector(&inputs[2]),
                matrix(&inputs[3]),
            );
            let beta = match centred {
                true => beta,
                false => beta.zeros_like(),
            };
            let reference_y = reference_forward(x.clone(), gamma.clone(), beta, EPSILON, centred);
            let reference = reference_backward(x, gamma, output_grad, EPSILON, centred);
            let beta_grad = match centred {
                true => values(reference.beta),
                false => vec![0.0; columns],
            };
            let reference = [
                values(reference_y),
                values(reference.x),
                values(reference.gamma),
                beta_grad,
            ];
            for (name, results) in [("fused", &fused), ("reference", &reference)] {
                for (i, (what, bound)) in [
                    ("output", 2e-5),
                    ("dx", 2e-5),
                    ("dgamma", 1e-4),
                    ("dbeta", 1e-4),
                ]
                .into_iter()
                .enumerate()
                {
                    let difference = max_difference(&results[i], &expected[i]);
                    assert!(
                        difference < bound,
                        "{name} (centred: {centred}), {columns} columns: {what} differs from Burn's by \
                         {difference} \
                         (bound {bound})"
                    );
                }
            }
        }
    }

    /// Rows far from 0 (mean 1000, spread 1) against the same LayerNorm in f64: the variance
    /// taken as `Σx²/n − μ²` would cancel 6 of f32's 7 digits there (an error of several
    /// percent); around the mean, the error is that of the mean itself, about `√n·ε·|μ|`
    /// (1e-3 at n = 200), times `r·γ` (up to about 3). Bound: 5e-3.
    #[test]
    fn rows_far_from_zero_keep_their_precision() {
        let device = Default::default();
        let (rows, columns) = (8, 200);
        Flex::seed(&device, 7);
        let x = Tensor::<Parallel<Flex>, 2>::random(
            [rows, columns],
            Distribution::Normal(1000.0, 1.0),
            &device,
        );
        let gamma =
            Tensor::<Parallel<Flex>, 1>::random([columns], Distribution::Normal(1.0, 0.5), &device);
        let y = values(layer_norm(x.clone(), gamma.clone(), None, EPSILON));
        let (x, gamma) = (values(x), values(gamma));
        for (r, row) in x.chunks(columns).enumerate() {
            let n = columns as f64;
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n;
            let variance = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
            let inverse = 1.0 / (variance + EPSILON).sqrt();
            for (c, &v) in row.iter().enumerate() {
                let exact = (v as f64 - mean) * inverse * gamma[c] as f64;
                let error = (y[r * columns + c] as f64 - exact).abs();
                assert!(
                    error < 5e-3,
                    "row {r}, column {c}: {} against {exact}",
                    y[r * columns + c]
                );
            }
        }
    }

    /// Without `β` the op adds nothing.
    #[test]
    fn no_beta_adds_nothing() {
        let device = Default::default();
        let x =
            Tensor::<Parallel<Flex>, 2>::from_floats([[1.0, 2.0, 4.0], [0.0, 0.0, 3.0]], &device);
        let gamma = Tensor::<Parallel<Flex>, 1>::from_floats([1.0, 2.0, 0.5], &device);
        let zero = Tensor::zeros([3], &device);
        let with_zero = values(layer_norm(x.clone(), gamma.clone(), Some(zero), EPSILON));
        assert_eq!(with_zero, values(layer_norm(x, gamma, None, EPSILON)));
    }

    #[test]
    #[should_panic(expected = "layer_norm: beta [2] for input [2, 3]")]
    fn a_parameter_of_another_width_is_refused() {
        let device = Default::default();
        let x = Tensor::<Parallel<Flex>, 2>::zeros([2, 3], &device);
        let gamma = Tensor::ones([3], &device);
        layer_norm(x, gamma, Some(Tensor::zeros([2], &device)), EPSILON);
    }
}
