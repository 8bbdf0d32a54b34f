//! SwiGLU as native loops on Flex in f32: `y = silu(g) ∘ u` and `[dg, du]` elementwise (see
//! [`super`]), parts in parallel, with the shared vectorised [`exp`].
//!
//! Inputs of another type (f16, bf16) run the reference.

use std::mem::MaybeUninit;

use burn_flex::FlexTensor;

use crate::kernels::flex::{
    exp, par_written, par_written_pair, readable_f32, tensor_f32, vectorised,
};

/// Elements per parallel task: about 64 Ki.
const CHUNK: usize = 65_536;

/// `σ(g) = 1 / (1 + e^−g)`.
#[inline(always)]
fn sigmoid(gate: f32) -> f32 {
    1.0 / (1.0 + exp(-gate))
}

/// The inputs as contiguous f32 tensors of one shape; `None` otherwise.
fn contiguous_f32<const N: usize>(inputs: [FlexTensor; N]) -> Option<[FlexTensor; N]> {
    let shape = inputs[0].layout().shape().clone();
    if inputs.iter().any(|t| *t.layout().shape() != shape) {
        return None;
    }
    let tensors: Vec<FlexTensor> = inputs
        .into_iter()
        .map(|t| readable_f32(t).map(|t| t.to_contiguous()))
        .collect::<Option<_>>()?;
    tensors.try_into().ok()
}

/// `silu(g) ∘ u` from `[g, u]`, both f32 of one shape.
pub fn forward(inputs: [FlexTensor; 2]) -> Option<[FlexTensor; 1]> {
    let [gate, up] = contiguous_f32(inputs)?;
    let shape = gate.layout().shape().clone();
    let (gates, ups) = (gate.as_slice::<f32>()?, up.as_slice::<f32>()?);
    // SAFETY: part `index` covers elements `index·CHUNK..` of the output, each written from the
    // same elements of `g` and `u` (the zip ends with the part).
    let (out, _) = unsafe {
        par_written(gates.len(), CHUNK, |index, out| {
            let start = index * CHUNK;
            let inputs = gates[start..].iter().zip(&ups[start..]);
            vectorised(
                #[inline(always)]
                || {
                    for (y, (&g, &u)) in out.iter_mut().zip(inputs) {
                        y.write(g * sigmoid(g) * u);
                    }
                },
            );
        })
    };
    Some([tensor_f32(out, shape)])
}

/// `[dg, du]` from `[g, u, dy]`, all f32 of one shape.
pub fn backward(inputs: [FlexTensor; 3]) -> Option<[FlexTensor; 2]> {
    let [gate, up, output_grad] = contiguous_f32(inputs)?;
    let shape = gate.layout().shape().clone();
    let (gates, ups) = (gate.as_slice::<f32>()?, up.as_slice::<f32>()?);
    let output_grads = output_grad.as_slice::<f32>()?;
    let fill =
        |index: usize, gate_grads: &mut [MaybeUninit<f32>], up_grads: &mut [MaybeUninit<f32>]| {
            let start = index * CHUNK;
            let outputs = gate_grads.iter_mut().zip(up_grads.iter_mut());
            let inputs = gates[start..]
                .iter()
                .zip(&ups[start..])
                .zip(&output_grads[start..]);
            vectorised(
                #[inline(always)]
                || {
                    for ((gate_grad, up_grad), ((&g, &u), &dy)) in outputs.zip(inputs) {
                        let s = sigmoid(g);
                        gate_grad.write(dy * u * (s * (1.0 + g * (1.0 - s))));
                        up_grad.write(dy * (g * s));
                    }
                },
            );
        };
    // SAFETY: part `index` of both outputs covers elements `index·CHUNK..`, each written from
    // the same elements of the inputs (the zip ends with the part).
    let grads = unsafe { par_written_pair(gates.len(), CHUNK, fill) };
    Some(grads.map(|grad| tensor_f32(grad, shape.clone())))
}
