//! The backend's integration tests: the fused kernels against their references (or f64) on Flex and Wgpu,
//! the decorator's routing, and the kernels under Burn's fusion.
//!
//! One test binary for the crate, its files as modules: every integration-test binary links Burn,
//! wgpu and CubeCL again.

#[macro_use]
mod common;

mod adamw;
mod bias_gelu;
mod cross_entropy;
#[cfg(feature = "cuda")]
mod cublaslt;
mod flash_attention;
mod fusion;
mod layer_norm;
mod mixed_matmul;
mod rope;
mod routing;
mod swiglu;
