//! Fused kernels and their reference implementations (see DESIGN.md: `backend/src/kernels/`).
//!
//! - [`attention`]: FlashAttention-2's forward and backward, as a reference in Burn tensor ops,
//!   and the autodiff op that runs them.
//! - [`flash`]: the same as CubeCL kernels, generic over the runtime.
//! - [`matmul`]: the mixed-precision matmul (f16/bf16 inputs, f32 accumulation, bias and GELU
//!   epilogue), kernel and reference, and the matmul precision policy of `Parallel<B>`.
//! - [`route`]: which of the two a call takes (the kernels on CubeCL backends, unless opted out).
//! - [`probe`]: whether a wgpu or CUDA device answers, and why not, for tests and benches.

pub mod attention;
pub mod flash;
pub mod matmul;
pub mod probe;
pub mod route;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor};

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
/// magnitude. The matmul kernel's epilogue computes the same form.
pub fn gelu_tanh_f32<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    const MINUS_TWO_SQRT_2_OVER_PI: f64 = -2.0 * 0.797_884_560_802_865_4;
    let cube = x.clone() * x.clone() * x.clone();
    let exponent = (x.clone() + cube * 0.044715) * MINUS_TWO_SQRT_2_OVER_PI;
    x / (exponent.clamp_max(80.0).exp() + 1.0)
}
