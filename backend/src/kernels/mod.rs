//! Fused kernels and their reference implementations (see DESIGN.md: `backend/src/kernels/`),
//! one module per op: its reference in Burn tensor ops, its routing and autodiff op in the
//! module itself, its CubeCL kernels in `cube` and its native loops on Flex in `flex`.
//!
//! - [`adamw`]: AdamW's step as one pass: bit for bit Burn's natively on Flex, one CubeCL kernel
//!   launch per tensor on wgpu and CUDA.
//! - [`attention`]: FlashAttention-2's forward and backward: the reference, the autodiff op
//!   that runs them, the CubeCL kernels ([`attention::cube`]) and Flex's tiled loops
//!   ([`attention::flex`]).
//! - [`cross_entropy`]: the output head's product and cross-entropy over blocks of rows,
//!   never holding the whole logits, its gradients computed in the forward, and its autodiff
//!   op; Burn's ops on every backend.
//! - [`bias_gelu`]: the MLP's bias add + GELU as one op each way (reference, CubeCL kernels,
//!   Flex's loops), and its autodiff op.
//! - [`layer_norm`]: LayerNorm and RMSNorm as one op each way (reference, CubeCL kernels,
//!   Flex's loops), and their autodiff op.
//! - [`rope`]: rotary position embeddings as one op each way (reference, CubeCL kernel,
//!   Flex's loops), keeping only its tables for the backward.
//! - [`swiglu`]: the gated MLP's `silu(g) ∘ u` as one op each way (reference, CubeCL kernels,
//!   Flex's loops), and its autodiff op.
//! - [`matmul`]: the mixed-precision matmul (f16/bf16 inputs, f32 accumulation, bias and GELU
//!   epilogue), kernel and reference, the matmul precision policy of `Parallel<B>`, and Flex's
//!   f32 matmul with its output written once ([`matmul::flex`]; Flex copies each one).
//! - [`add`]: Flex's add on rayon's threads where Flex's own is slow.
//! - [`choice`]: which of a model's fusable ops run fused, per op and per device kind.
//! - [`cube_kernel`]: what a CubeCL kernel is to the router (a check of its inputs' shapes
//!   and types, then a launch).
//! - [`flex`]: what the ops' Flex loops share (f32 views, single-threaded products, parallel
//!   writes, a vectorised `exp`).
//! - `launch`: what the CubeCL kernels' launches share (output buffers, elementwise grids).
//! - [`route`]: which a call takes (the kernels on CubeCL backends, launched or queued in
//!   Burn's fusion stream, and on Flex, unless opted out; the reference otherwise), counted and
//!   logged per op.
//! - [`probe`]: whether a wgpu or CUDA device answers, and why not, for tests and benches.
//! - [`simd`]: which SIMD (AVX-512 or AVX2) the CPU kernels take on this machine.

pub mod adamw;
pub mod add;
pub mod attention;
pub mod bias_gelu;
pub mod choice;
pub mod cross_entropy;
pub mod cube_kernel;
pub mod flex;
mod launch;
pub mod layer_norm;
pub mod matmul;
pub mod probe;
pub mod rope;
pub mod route;
pub mod simd;
pub mod swiglu;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Shape, Tensor, TensorMetadata, TensorPrimitive};

/// A float primitive of backend `B` as a rank-`D` `Tensor` (what the ops here hand back after
/// running on primitives).
pub(crate) fn tensor<B: Backend, const D: usize>(primitive: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// `t: [.., n]` as the matrix of its rows, `[rows, n]` (what the row-wise fused ops' references
/// compute on).
pub(crate) fn as_rows<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 2> {
    let shape = t.shape();
    let columns = shape[shape.num_dims() - 1];
    let rows = shape.num_elements().checked_div(columns).unwrap_or(0);
    tensor(B::float_reshape(t, Shape::new([rows, columns])))
}

/// A primitive in `dtype`, as it is when it already is (the fused ops' gradients, computed in
/// f32, in their inputs' types).
pub(crate) fn cast_primitive<B: Backend>(t: FloatTensor<B>, dtype: FloatDType) -> FloatTensor<B> {
    match t.dtype() == DType::from(dtype) {
        true => t,
        false => B::float_cast(t, dtype),
    }
}

/// `tensor` in `dtype`; unchanged, without a graph node, when it already is. The kernels
/// compute half-precision inputs in f32 through it, and mixed-precision training casts its fp32
/// weights to the compute type with it (`wildfire_parallel::precision`).
pub fn in_dtype<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
    dtype: FloatDType,
) -> Tensor<B, D> {
    if tensor.dtype() == DType::from(dtype) {
        tensor
    } else {
        tensor.cast(dtype)
    }
}

/// GPT-2's GELU, `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`, on an f32 tensor, computed as the
/// equal `x / (1 + exp(−2√(2/π)(x + 0.044715x³)))` (from `½(1 + tanh z) = σ(2z)`), with `x³` as
/// products: one `exp`, where Burn's `gelu_approximate` goes through `powf` and `tanh`.
///
/// The exponent is clamped at 80: for very negative x (below −9.5) `exp` would overflow to +∞,
/// and although the quotient's limit is the right −0, a backward would multiply the overflowed
/// `exp` by a zero gradient, NaN. At the clamp the quotient is already below 1e-33 in
/// magnitude. The kernels of [`bias_gelu`] compute the same form.
pub fn gelu_tanh_f32<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let exponent = gelu_exponent(x.clone());
    x / (exponent.clamp_max(GELU_EXPONENT_CLAMP).exp() + 1.0)
}

/// `√(2/π)`, GELU's `c`.
const GELU_C: f64 = 0.797_884_560_802_865_4;
/// GELU's cubic coefficient `a`.
const GELU_A: f64 = 0.044715;
/// Where GELU's exponent is clamped (see [`gelu_tanh_f32`]).
const GELU_EXPONENT_CLAMP: f64 = 80.0;

/// GELU's exponent `−2c(x + a·x³)`, with `x³` as products.
fn gelu_exponent<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let cube = x.clone() * x.clone() * x.clone();
    (x + cube * GELU_A) * (-2.0 * GELU_C)
}
