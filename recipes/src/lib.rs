//! wildfire recipes: the GPT model, its data pipeline and training loop (on burn-train),
//! checkpoints, generation, Hugging Face GPT-2 interoperability, and the `wildfire` command line.

pub mod alloc;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod data;
pub mod device;
pub mod generate;
pub mod hf;
pub mod logging;
pub mod model;
pub mod optim;
pub mod train;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::{
    BalancedCheckpointing, CheckpointStrategy, NoCheckpointing,
};
use burn::tensor::backend::AutodiffBackend;
use wildfire_backend::DecoratedBackend;
use wildfire_backend::device::RankDevice;

/// The recipe's CPU backend: Burn's `Flex` under the `Parallel` decorator, whose collectives
/// carry tensor parallelism (with one rank they are never called).
pub type CpuBackend = wildfire_backend::Parallel<burn::backend::Flex>;

/// A backend the recipe trains on: autodiff over a backend with collectives, e.g.
/// `Autodiff<Parallel<Flex>>` (evaluation runs on the inner backend, so it has them too).
pub trait TrainBackend:
    AutodiffBackend<InnerBackend: DecoratedBackend> + DecoratedBackend + RankDevice
{
    /// Whether its autodiff recomputes memory-bound operations in the backward (Burn's
    /// `BalancedCheckpointing`): selective activation checkpointing.
    const RECOMPUTES_MEMORY_BOUND_OPS: bool;
}

/// Burn's autodiff checkpointing strategies, told apart.
pub trait StrategyKind: CheckpointStrategy {
    const RECOMPUTES_MEMORY_BOUND_OPS: bool;
}

impl StrategyKind for NoCheckpointing {
    const RECOMPUTES_MEMORY_BOUND_OPS: bool = false;
}

impl StrategyKind for BalancedCheckpointing {
    const RECOMPUTES_MEMORY_BOUND_OPS: bool = true;
}

impl<B: DecoratedBackend + RankDevice, C: StrategyKind> TrainBackend for Autodiff<B, C>
where
    Autodiff<B, C>: DecoratedBackend,
{
    const RECOMPUTES_MEMORY_BOUND_OPS: bool = C::RECOMPUTES_MEMORY_BOUND_OPS;
}
