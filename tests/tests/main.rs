//! Cross-crate integration tests: collectives, the decorator, tensor-parallel mappings, tcp
//! processes, faults, and a Burn user's model under the data-parallel burn-train strategy,
//! split by a tensor-parallel plan or into pipeline stages, and resumed from a checkpoint under
//! another layout.
//!
//! One test binary for the crate, its files as modules: every integration-test binary links Burn,
//! wgpu and CubeCL again.

use wildfire_backend::alloc::CountingAlloc;

/// Counts only where a test enables it (the memory runs of the data-parallel example).
#[global_allocator]
static HEAP: CountingAlloc = CountingAlloc::new();

mod collectives;
mod data_parallel_example;
mod decorator;
mod faults;
#[cfg(feature = "cuda")]
mod gpu;
mod pipeline_example;
mod resume_example;
mod tcp;
mod tensor_parallel;
mod tensor_parallel_example;
