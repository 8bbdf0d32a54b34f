//! Burn users' programs under wildfire: their own models on Burn's `SupervisedTraining`, with a
//! wildfire strategy. Each program is a module here (so the tests can run it on thread ranks)
//! and a thin binary in `src/bin/` (so `wildfire launch` can run it as processes).

pub mod mlp;
