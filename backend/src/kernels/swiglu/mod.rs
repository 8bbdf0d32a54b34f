//! SwiGLU with its fused backward: the gated MLP's `silu(g) ∘ u` (Llama's, `g` and `u` the gate
//! and up projections) as one elementwise pass each way, saving only `g` and `u` for the
//! backward.
//!
//! With `g, u` of one shape, all computed in f32:
//!
//! ```text
//! y = silu(g) ∘ u,        silu(g) = g·σ(g),        σ(g) = 1 / (1 + e^−g)
//! ```
//!
//! **Backward**, given `dy`: from `σ' = σ(1 − σ)`, `silu'(g) = σ(g)·(1 + g·(1 − σ(g)))`, so
//!
//! ```text
//! dg = dy ∘ u ∘ σ(g)·(1 + g·(1 − σ(g)))        du = dy ∘ silu(g)
//! ```
//!
//! No clamp is needed: where `e^−g` overflows (g < −88) `σ` is 0 and so are `y`, `dg` and `du`
//! (`g` itself stays finite); where it underflows `σ` is 1.
//!
//! The autodiff node keeps `g` and `u`. The composed graph (`silu` as `g·σ(g)`, then the product
//! with `u`) keeps `σ(g)` and `silu(g)` as well, two more tensors of the MLP's hidden width per
//! block, and runs five elementwise passes forward and more back where the fused op runs one each
//! way.
//!
//! `g` and `u` in f32, f16 or bf16 (the same type) give `y`, `dg` and `du` in that type, each
//! rounded once from f32. On CubeCL backends the passes are the kernels of [`cube`], on Flex in
//! f32 the loops of [`flex`]; elsewhere the reference in Burn ops.

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
use burn::tensor::{FloatDType, Shape, Tensor, TensorMetadata};

use super::cube_kernel::CubeKernel;
use super::route::{on_cube, on_flex, took_reference};
use super::{as_rows, in_dtype, tensor};
use crate::Parallel;

pub(crate) mod cube;
pub mod flex;

pub use cube::{backward_kernel, forward_kernel};

/// A backend with the fused SwiGLU (see the module doc) on a gate and an up projection of one
/// shape, whose autodiff backward is the fused one.
pub trait FusedSwigluBackend: Backend {
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// `silu(gate) ∘ up` (see the module doc), in their type.
///
/// # Panics
/// When the two differ in shape or type, naming both.
pub fn swiglu<B: FusedSwigluBackend, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
) -> Tensor<B, D> {
    assert!(
        gate.dims() == up.dims() && gate.dtype() == up.dtype(),
        "swiglu: gate {:?} {:?} and up {:?} {:?} (they must be of one shape and type)",
        gate.dims(),
        gate.dtype(),
        up.dims(),
        up.dtype()
    );
    let (gate, up) = (gate.into_primitive().tensor(), up.into_primitive().tensor());
    tensor(B::swiglu(gate, up))
}

/// The reference forward: `silu(g) ∘ u` in f32 with Burn ops, returned in `g`'s type.
pub fn reference_forward<B: Backend>(gate: Tensor<B, 2>, up: Tensor<B, 2>) -> Tensor<B, 2> {
    let dtype = FloatDType::from(gate.dtype());
    let (gate, up) = (in_f32(gate), in_f32(up));
    let sigmoid = sigmoid_f32(gate.clone());
    in_dtype(gate * sigmoid * up, dtype)
}

/// The reference backward: `[dg, du]` (see the module doc), in `g`'s type.
pub fn reference_backward<B: Backend>(
    gate: Tensor<B, 2>,
    up: Tensor<B, 2>,
    output_grad: Tensor<B, 2>,
) -> [Tensor<B, 2>; 2] {
    let dtype = FloatDType::from(gate.dtype());
    let (gate, up, output_grad) = (in_f32(gate), in_f32(up), in_f32(output_grad));
    let sigmoid = sigmoid_f32(gate.clone());
    let silu = gate.clone() * sigmoid.clone();
    let slope = sigmoid.clone() * ((sigmoid.neg() + 1.0) * gate + 1.0);
    let gate_grad = output_grad.clone() * up * slope;
    let up_grad = output_grad * silu;
    [gate_grad, up_grad].map(|grad| in_dtype(grad, dtype))
}

fn in_f32<B: Backend>(t: Tensor<B, 2>) -> Tensor<B, 2> {
    in_dtype(t, FloatDType::F32)
}

/// `σ(g) = 1 / (1 + e^−g)` on an f32 tensor.
fn sigmoid_f32<B: Backend>(gate: Tensor<B, 2>) -> Tensor<B, 2> {
    (gate.neg().exp() + 1.0).recip()
}

/// `t` (of `[rows, n]`) reshaped to `shape`.
fn reshaped<B: Backend>(t: Tensor<B, 2>, shape: Shape) -> FloatTensor<B> {
    B::float_reshape(t.into_primitive().tensor(), shape)
}

/// The forward on backend `B`: the CubeCL kernel on CubeCL backends and the native loop on Flex
/// (unless opted out), the reference otherwise.
fn forward_on<B: Backend>(inputs: [FloatTensor<B>; 2]) -> FloatTensor<B> {
    let kernel = cube::Forward;
    let routed =
        on_cube(&kernel, inputs).or_else(|inputs| on_flex(kernel.op(), inputs, flex::forward));
    match routed {
        Ok([y]) => y,
        Err([gate, up]) => {
            took_reference(kernel.op());
            let shape = gate.shape();
            reshaped(reference_forward::<B>(as_rows(gate), as_rows(up)), shape)
        }
    }
}

/// `[dg, du]` on backend `B` from `[gate, up, output_grad]`: the CubeCL kernel on CubeCL
/// backends and the native loop on Flex (unless opted out), the reference otherwise.
fn backward_on<B: Backend>(inputs: [FloatTensor<B>; 3]) -> [FloatTensor<B>; 2] {
    let kernel = cube::Backward;
    let routed =
        on_cube(&kernel, inputs).or_else(|inputs| on_flex(kernel.op(), inputs, flex::backward));
    match routed {
        Ok(grads) => grads,
        Err([gate, up, output_grad]) => {
            took_reference(kernel.op());
            let shape = gate.shape();
            reference_backward::<B>(as_rows(gate), as_rows(up), as_rows(output_grad))
                .map(|grad| reshaped(grad, shape.clone()))
        }
    }
}

impl<B: Backend> FusedSwigluBackend for Parallel<B> {
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        forward_on::<Self>([gate, up])
    }
}

/// The autodiff node of the fused SwiGLU. Memory-bound for the checkpointing strategies, like
/// the elementwise ops it replaces: under Burn's balanced checkpointing its output is recomputed
/// in the backward ([`RetroSwiglu`]) rather than kept; its state is the ids of `g` and `u`,
/// whose values the checkpointer keeps.
#[derive(Debug)]
struct SwigluBackward;

impl<B: Backend> Backward<Parallel<B>, 2> for SwigluBackward {
    type State = [NodeId; 2];

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let output_grad = grads.consume::<Parallel<B>>(&ops.node);
        let [gate, up] = ops
            .state
            .map(|id| checkpointer.retrieve_node_output::<FloatTensor<Parallel<B>>>(id));
        let input_grads = backward_on::<Parallel<B>>([gate, up, output_grad]);
        for (node, grad) in ops.parents.into_iter().zip(input_grads) {
            if let Some(node) = node {
                grads.register::<Parallel<B>>(node.id, grad);
            }
        }
    }
}

/// The forward again, from the inputs `[g, u]` (by node id), for a checkpointed backward.
#[derive(Debug)]
struct RetroSwiglu<B> {
    inputs: [NodeId; 2],
    backend: PhantomData<B>,
}

impl<B: Backend> RetroForward for RetroSwiglu<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let inputs = self
            .inputs
            .map(|id| states.get_state::<FloatTensor<Parallel<B>>>(&id));
        states.save(out_node, forward_on::<Parallel<B>>(inputs))
    }
}

impl<B: Backend, C: CheckpointStrategy> FusedSwigluBackend for Autodiff<Parallel<B>, C> {
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let inputs = [&gate, &up];
        let retro = RetroSwiglu::<B> {
            inputs: inputs.map(|input| input.node.id),
            backend: PhantomData,
        };
        let prepared = SwigluBackward
            .prepare::<C>(inputs.map(|input| input.node.clone()))
            .memory_bound()
            .retro_forward(retro)
            .parents(inputs)
            .stateful();
        let y = forward_on::<Parallel<B>>(inputs.map(|input| input.primitive.clone()));
        match prepared {
            OpsKind::Tracked(mut prep) => {
                let state = [prep.checkpoint(&gate), prep.checkpoint(&up)];
                prep.finish(state, y)
            }
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}
