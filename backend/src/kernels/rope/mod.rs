//! Rotary position embeddings (Llama's, on rotate-half pairs) as one op each way, keeping no
//! copy of its input for the backward.
//!
//! For `x: [batch, seq, heads, d]` and tables `cos, sin: [seq, d]` (row `p` holding position
//! `p`'s angles, each angle in both halves of the row):
//!
//! ```text
//! y = x ∘ cos + rot(x) ∘ sin,        rot(x₁, x₂) = (−x₂, x₁) on the halves of each head
//! ```
//!
//! `rot` is orthogonal with `rotᵀ = −rot`, and the tables repeat each angle in both halves, so
//! the backward is the same op with `−sin`:
//!
//! ```text
//! dx = dy ∘ cos + rotᵀ(dy ∘ sin) = dy ∘ cos + rot(dy) ∘ (−sin)
//! ```
//!
//! The autodiff node keeps the two tables (`seq × d` each) and nothing of `x`'s size. Each
//! output is `a·c + b·s` with `b` an exact copy or negation of an input, two products and one
//! sum in the order Burn's ops take for `x·cos + rot(x)·sin`, so the op equals those composed
//! ops exactly, at any SIMD width (an elementwise computation has no order of summation to
//! change), forward and backward.
//!
//! On CubeCL backends the op is the kernel of [`cube`] (one unit per element), on Flex in f32
//! the loops of [`flex`] (positions in parallel); elsewhere the reference in Burn ops. The
//! kernel computes the same expression, but a GPU compiler may contract it into a fused
//! multiply-add, so there it agrees with the composed ops within rounding, not bitwise.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use super::cube_kernel::CubeKernel;
use super::route::{on_cube, on_flex, took_reference};
use super::tensor;
use crate::Parallel;

pub(crate) mod cube;
pub mod flex;

pub use cube::rope_kernel;

/// A backend with the fused rotary embedding (see the module doc) on `x: [batch, seq, heads, d]`
/// with tables `cos, sin: [seq, d]`, whose autodiff backward is the fused one.
pub trait FusedRopeBackend: Backend {
    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// `x ∘ cos + rot(x) ∘ sin` (see the module doc), in `x`'s type; the tables must be in it too,
/// and each of their rows must hold its angles in both halves (the backward relies on it).
///
/// # Panics
/// When the head width `d` is odd or a table is not `[seq, d]`, naming the shapes.
pub fn rope<B: FusedRopeBackend>(
    x: Tensor<B, 4>,
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
) -> Tensor<B, 4> {
    let shape = x.dims();
    let [_, seq, _, width] = shape;
    assert!(
        width.is_multiple_of(2),
        "rope: heads of odd width {width} (input {shape:?})"
    );
    for (name, table) in [("cos", &cos), ("sin", &sin)] {
        assert_eq!(
            table.dims(),
            [seq, width],
            "rope: {name} table {:?} for input {shape:?} (one row per position)",
            table.dims()
        );
    }
    let [x, cos, sin] = [
        x.into_primitive().tensor(),
        cos.into_primitive().tensor(),
        sin.into_primitive().tensor(),
    ];
    tensor(B::fused_rope(x, cos, sin))
}

/// The reference in Burn ops: the halves sliced apart and joined rotated.
pub fn reference<B: Backend>(
    x: Tensor<B, 4>,
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
) -> Tensor<B, 4> {
    let [batch, seq, heads, width] = x.dims();
    let half = width / 2;
    let first = x.clone().slice([0..batch, 0..seq, 0..heads, 0..half]);
    let second = x.clone().slice([0..batch, 0..seq, 0..heads, half..width]);
    let rotated = Tensor::cat(vec![second.neg(), first], 3);
    let table = |t: Tensor<B, 2>| t.reshape([1, seq, 1, width]);
    x * table(cos) + rotated * table(sin)
}

/// The op on backend `B`: the CubeCL kernel on CubeCL backends and the native loops on Flex
/// (unless opted out), the reference otherwise.
fn forward_on<B: Backend>(inputs: [FloatTensor<B>; 3]) -> FloatTensor<B> {
    let kernel = cube::Rope;
    match on_cube(&kernel, inputs).or_else(|inputs| on_flex(kernel.op(), inputs, flex::rope)) {
        Ok([y]) => y,
        Err([x, cos, sin]) => {
            took_reference(kernel.op());
            reference::<B>(tensor(x), tensor(cos), tensor(sin))
                .into_primitive()
                .tensor()
        }
    }
}

impl<B: Backend> FusedRopeBackend for Parallel<B> {
    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        forward_on::<Self>([x, cos, sin])
    }
}

/// The autodiff node of the rotary embedding; it keeps the tables `[cos, sin]`.
#[derive(Debug)]
struct RopeBackward;

impl<B: Backend> Backward<Parallel<B>, 1> for RopeBackward {
    type State = [FloatTensor<Parallel<B>>; 2];

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let output_grad = grads.consume::<Parallel<B>>(&ops.node);
        let [cos, sin] = ops.state;
        let [x_node] = ops.parents;
        if let Some(node) = x_node {
            let minus_sin = <Parallel<B> as burn::tensor::ops::FloatTensorOps<_>>::float_neg(sin);
            let grad = forward_on::<Parallel<B>>([output_grad, cos, minus_sin]);
            grads.register::<Parallel<B>>(node.id, grad);
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> FusedRopeBackend for Autodiff<Parallel<B>, C> {
    fn fused_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let nodes = [x.node.clone()];
        let (cos, sin) = (cos.primitive, sin.primitive);
        let y = forward_on::<Parallel<B>>([x.primitive, cos.clone(), sin.clone()]);
        // Compute-bound for the checkpointing strategies: recomputing it would need `x`, which
        // the node does not keep.
        match RopeBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish([cos, sin], y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::{Distribution, TensorData};

    use super::*;

    type Fused = Autodiff<Parallel<Flex>>;

    fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    /// `[y, dx]` of `Σ y ∘ dy` through `op` on backend `B`.
    fn output_and_grad<B: burn::tensor::backend::AutodiffBackend>(
        data: &[Vec<f32>; 4],
        shape: [usize; 4],
        op: impl Fn(Tensor<B, 4>, Tensor<B, 2>, Tensor<B, 2>) -> Tensor<B, 4>,
    ) -> [Vec<f32>; 2] {
        let device = Default::default();
        let [x, cos, sin, dy] = data;
        let table = |v: &Vec<f32>| {
            Tensor::<B, 2>::from_data(TensorData::new(v.clone(), [shape[1], shape[3]]), &device)
        };
        let activation =
            |v: &Vec<f32>| Tensor::<B, 4>::from_data(TensorData::new(v.clone(), shape), &device);
        let (x, dy) = (activation(x).require_grad(), activation(dy));
        let y = op(x.clone(), table(cos), table(sin));
        let grads = (y.clone() * dy).sum().backward();
        [values(y), values(x.grad(&grads).unwrap())]
    }

    /// The fused op (Flex's loops) and its reference, both under autodiff, give the same
    /// outputs and input gradients, bit for bit, on a head width of 6 (3 pairs, no multiple of
    /// the SIMD lanes) and of 64.
    #[test]
    fn the_loops_equal_the_reference_exactly() {
        let device = Default::default();
        for (shape, seed) in [([2, 5, 3, 6], 1), ([2, 7, 4, 64], 2)] {
            Flex::seed(&device, seed);
            let draw = |len: usize| {
                values(Tensor::<Flex, 1>::random(
                    [len],
                    Distribution::Normal(0.0, 1.0),
                    &device,
                ))
            };
            let [batch, seq, heads, width] = shape;
            let elements = batch * seq * heads * width;
            // Each row's angles in both halves, as rotary tables hold them.
            let table = |halves: Vec<f32>| -> Vec<f32> {
                halves
                    .chunks(width / 2)
                    .flat_map(|row| row.repeat(2))
                    .collect()
            };
            let (cos, sin) = (table(draw(seq * width / 2)), table(draw(seq * width / 2)));
            let data = [draw(elements), cos, sin, draw(elements)];
            let fused = output_and_grad::<Fused>(&data, shape, rope);
            let composed = output_and_grad::<Autodiff<Flex>>(&data, shape, reference);
            assert_eq!(fused, composed, "{shape:?}");
        }
    }

    #[test]
    #[should_panic(expected = "rope: sin table [4, 6] for input [1, 3, 2, 6]")]
    fn a_table_of_other_positions_is_refused() {
        let device = Default::default();
        let x = Tensor::<Parallel<Flex>, 4>::zeros([1, 3, 2, 6], &device);
        rope(
            x,
            Tensor::zeros([3, 6], &device),
            Tensor::zeros([4, 6], &device),
        );
    }
}
