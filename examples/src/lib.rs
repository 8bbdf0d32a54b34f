//! Burn users' programs under wildfire: their own models on Burn's `SupervisedTraining` with a
//! wildfire strategy, or split by a tensor-parallel plan or into pipeline stages in a loop of
//! Burn's pieces. Each program is a module here (so the tests can run it on thread ranks or as
//! processes) and a thin binary in `src/bin/` (so `wildfire launch` can run it as processes).

pub mod checkpoints;
pub mod mlp;
pub mod pipeline;
pub mod tensor_parallel;
