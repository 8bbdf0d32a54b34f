//! The recipe's integration tests: the `wildfire` binary and its model, serial and parallel.
//!
//! One test binary for the crate, its files as modules: every integration-test binary links Burn,
//! wgpu and CubeCL again.

mod common;

mod activation_checkpointing;
mod activation_memory;
mod cli;
mod data_parallel;
mod devices;
mod fused_ops;
mod hf_models;
mod llama;
mod pipeline;
mod precision;
mod prepare;
mod recipe;
mod tensor_parallel;
mod tokenizer;
