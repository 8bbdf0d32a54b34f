//! Cross-crate integration tests: collectives, the decorator, tensor-parallel mappings, tcp
//! processes and faults.
//!
//! One test binary for the crate, its files as modules: every integration-test binary links Burn,
//! wgpu and CubeCL again.

mod collectives;
mod decorator;
mod faults;
#[cfg(feature = "cuda")]
mod gpu;
mod tcp;
mod tensor_parallel;
