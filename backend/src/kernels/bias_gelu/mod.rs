//! Fused bias + GELU with its fused backward: the MLP's `g(x + b)` after its first matmul, as
//! Megatron-LM's bias-GELU fusion does it (one elementwise pass each way, saving only `x` and
//! `b` for the backward).
//!
//! With `x: [.., n]` (its rows: every index but the last), `b: [n]` broadcast over the rows and
//! `z = x + b`, all computed in f32:
//!
//! ```text
//! y = g(z) = z·s,    s = σ(2u) = 1 / (1 + e^E),    E = −2u = −2c(z + a·z³),    c = √(2/π), a = 0.044715
//! ```
//!
//! which is GPT-2's `½z(1 + tanh u)` (`½(1 + tanh u) = σ(2u)`), with `E` clamped at 80 as in
//! [`super::gelu_tanh_f32`]. **Backward**, given `dy`: from `ds/dz = s(1 − s)·2c(1 + 3a·z²)`,
//!
//! ```text
//! g'(z) = s + z·s(1 − s)·2c(1 + 3a·z²)   where E < 80;   s where the clamp holds E (there the
//!                                                        computed form is constant in E)
//! dx = dy ∘ g'(z)        db = Σ_rows dx
//! ```
//!
//! The autodiff node keeps `x` and `b` only. The decomposed graph of the same computation keeps
//! five tensors of `x`'s size in f32 (`z`, `z²`, `E`, `e^E` and `1 + e^E`), so the fused op
//! lowers the activation memory of a GPT's MLP by about four of its hidden activations per
//! block, and replaces the decomposed forward's and backward's dozen elementwise passes with one
//! kernel each way.
//!
//! `x` in f32, f16 or bf16 comes back in its type; `b` may be in any float type (the GPT passes
//! its fp32 parameter, unrounded). On CubeCL backends the passes are the kernels of [`cube`]
//! (the forward is the matmul's epilogue kernel), on Flex in f32 the loops of [`flex`];
//! elsewhere the reference in Burn ops.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Shape, Tensor, TensorMetadata};

use super::cube_kernel::CubeKernel;
use super::route::{on_cube, on_flex, took_reference};
use super::{
    GELU_A, GELU_C, GELU_EXPONENT_CLAMP, as_rows, cast_primitive, gelu_exponent, gelu_tanh_f32,
    in_dtype, tensor,
};
use crate::Parallel;

pub(crate) mod cube;
pub mod flex;

pub use cube::{backward_kernel, forward_kernel};

/// A backend with the fused bias + GELU op (see the module doc): `g(x + b)` on `x: [.., n]` (any
/// rank; the rows are all but the last dim) and `b: [n]`, whose autodiff backward is the fused
/// one.
pub trait FusedBiasGeluBackend: Backend {
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// `g(x + b)` on `x: [.., n]` (any rank) and `b: [n]`, in `x`'s type (see the module doc).
///
/// # Panics
/// When `b` is not `[n]`, naming both shapes.
pub fn bias_gelu<B: FusedBiasGeluBackend, const D: usize>(
    x: Tensor<B, D>,
    bias: Tensor<B, 1>,
) -> Tensor<B, D> {
    let shape = x.dims();
    let columns = shape[D - 1];
    assert_eq!(
        bias.dims(),
        [columns],
        "bias_gelu: bias {:?} for input {shape:?} (the bias has one value per column)",
        bias.dims()
    );
    let (x, bias) = (x.into_primitive().tensor(), bias.into_primitive().tensor());
    tensor(B::bias_gelu(x, bias))
}

/// The reference forward: `g(x + b)` in f32 with Burn ops, returned in `x`'s type.
pub fn reference_forward<B: Backend>(x: Tensor<B, 2>, bias: Tensor<B, 1>) -> Tensor<B, 2> {
    let dtype = FloatDType::from(x.dtype());
    in_dtype(gelu_tanh_f32(biased(x, bias)), dtype)
}

/// The reference backward: `dx = dy ∘ g'(x + b)`, in f32 (the caller rounds it to `x`'s type
/// and sums it over the rows for `db`).
pub fn reference_backward<B: Backend>(
    x: Tensor<B, 2>,
    bias: Tensor<B, 1>,
    output_grad: Tensor<B, 2>,
) -> Tensor<B, 2> {
    in_dtype(output_grad, FloatDType::F32) * gelu_slope_f32(biased(x, bias))
}

/// `z = x + b` in f32.
fn biased<B: Backend>(x: Tensor<B, 2>, bias: Tensor<B, 1>) -> Tensor<B, 2> {
    in_dtype(x, FloatDType::F32) + in_dtype(bias, FloatDType::F32).unsqueeze()
}

/// `g'(z)` of the clamped form (see the module doc), on an f32 tensor.
fn gelu_slope_f32<B: Backend>(z: Tensor<B, 2>) -> Tensor<B, 2> {
    let exponent = gelu_exponent(z.clone());
    let unclamped = exponent.clone().lower_elem(GELU_EXPONENT_CLAMP).float();
    let s = (exponent.clamp_max(GELU_EXPONENT_CLAMP).exp() + 1.0).recip();
    let growth = z.clone() * z.clone() * (3.0 * GELU_A) + 1.0;
    let slope_of_s = s.clone() * (s.clone().neg() + 1.0) * growth * (2.0 * GELU_C);
    s + z * slope_of_s * unclamped
}

/// `t` (of `[rows, n]`) reshaped to `shape`.
fn reshaped<B: Backend>(t: Tensor<B, 2>, shape: Shape) -> FloatTensor<B> {
    B::float_reshape(t.into_primitive().tensor(), shape)
}

/// The forward on backend `B`: the CubeCL kernel on CubeCL backends and the native loop on Flex
/// (unless opted out), the reference otherwise.
fn forward_on<B: Backend>(x: FloatTensor<B>, bias: FloatTensor<B>) -> FloatTensor<B> {
    let kernel = cube::Forward;
    let routed = on_cube(&kernel, [x, bias])
        .or_else(|inputs| on_flex(kernel.op(), inputs, flex::bias_gelu_forward));
    match routed {
        Ok([y]) => y,
        Err([x, bias]) => {
            took_reference(kernel.op());
            let shape = x.shape();
            reshaped(reference_forward::<B>(as_rows(x), tensor(bias)), shape)
        }
    }
}

/// `dx` in f32 on backend `B` from `[x, bias, output_grad]`: the CubeCL kernel on CubeCL
/// backends and the native loop on Flex (unless opted out), the reference otherwise.
fn backward_on<B: Backend>(inputs: [FloatTensor<B>; 3]) -> FloatTensor<B> {
    let kernel = cube::Backward;
    let routed = on_cube(&kernel, inputs)
        .or_else(|inputs| on_flex(kernel.op(), inputs, flex::bias_gelu_backward));
    match routed {
        Ok([grad]) => grad,
        Err([x, bias, output_grad]) => {
            took_reference(kernel.op());
            let shape = x.shape();
            let grad = reference_backward::<B>(as_rows(x), tensor(bias), as_rows(output_grad));
            reshaped(grad, shape)
        }
    }
}

/// `db = Σ_rows dx` from `dx: [.., n]` in f32, summed over the leading dims one at a time: a
/// whole layer and a column-parallel part of it sum each column in the same order, so their
/// bias gradients agree bitwise.
fn bias_grad<B: Backend>(grad: FloatTensor<B>, columns: usize) -> FloatTensor<B> {
    let leading = grad.shape().num_dims() - 1;
    let sum = (0..leading).fold(grad, |sum, dim| B::float_sum_dim(sum, dim));
    B::float_reshape(sum, Shape::new([columns]))
}

impl<B: Backend> FusedBiasGeluBackend for Parallel<B> {
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        forward_on::<Self>(x, bias)
    }
}

/// The autodiff node of the fused bias + GELU; it keeps `[x, bias]`.
#[derive(Debug)]
struct BiasGeluBackward;

impl<B: Backend> Backward<Parallel<B>, 2> for BiasGeluBackward {
    type State = [FloatTensor<Parallel<B>>; 2];

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let output_grad = grads.consume::<Parallel<B>>(&ops.node);
        let [x, bias] = ops.state;
        let (x_dtype, bias_dtype) = (FloatDType::from(x.dtype()), FloatDType::from(bias.dtype()));
        let columns = bias.shape()[0];
        let grad = backward_on::<Parallel<B>>([x, bias, output_grad]);
        let [x_node, bias_node] = ops.parents;
        if let Some(node) = bias_node {
            let bias_grad = bias_grad::<Parallel<B>>(grad.clone(), columns);
            grads.register::<Parallel<B>>(
                node.id,
                cast_primitive::<Parallel<B>>(bias_grad, bias_dtype),
            );
        }
        if let Some(node) = x_node {
            grads.register::<Parallel<B>>(node.id, cast_primitive::<Parallel<B>>(grad, x_dtype));
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> FusedBiasGeluBackend for Autodiff<Parallel<B>, C> {
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        let nodes = [x.node.clone(), bias.node.clone()];
        let (x, bias) = (x.primitive, bias.primitive);
        let y = forward_on::<Parallel<B>>(x.clone(), bias.clone());
        // Compute-bound like a matmul for the checkpointing strategies: the node keeps its
        // inputs rather than asking for them to be recomputed.
        match BiasGeluBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish([x, bias], y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}
