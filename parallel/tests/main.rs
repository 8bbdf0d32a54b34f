//! The parallel library's integration tests: data parallelism and ZeRO, tensor-parallel layers,
//! ranks as threads, and tensor-parallel checkpoints resharded on load.
//!
//! One test binary for the crate, its files as modules: every integration-test binary links Burn,
//! wgpu and CubeCL again.

mod common;

mod checkpoint;
mod data_parallel;
mod tensor_parallel;
