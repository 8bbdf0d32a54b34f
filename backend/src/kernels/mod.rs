//! Fused kernels and their reference implementations (see DESIGN.md: `backend/src/kernels/`).
//!
//! - [`attention`]: FlashAttention-2's forward and backward, as a reference in Burn tensor ops,
//!   and the autodiff op that runs them.
//! - [`flash`]: the same as CubeCL kernels, generic over the runtime.
//! - [`route`]: which of the two a call takes (the kernels on CubeCL backends, when opted in).

pub mod attention;
pub mod flash;
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
