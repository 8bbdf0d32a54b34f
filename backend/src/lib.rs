//! wildfire's backend layer: collective communication for Burn tensors on every backend
//! ([`comm`]), the backend decorator [`Parallel<B>`] (which counts [`blocking_reads`]), fused
//! kernels ([`kernels`]), the CUDA seam for library calls on CubeCL's stream (`cuda`, with
//! `--features cuda`), each rank's device and backend ([`device`]), what meets Burn's fusion
//! stream ([`fusion`]), tensor values read back to the host whatever their alignment
//! ([`host_data`]), the process launcher behind `wildfire launch` ([`launch`]), and tables of
//! the kernels a few steps ran ([`profile`]).

pub mod alloc;
pub mod collective;
pub mod comm;
pub mod compare;
#[cfg(feature = "cuda")]
pub mod cuda;
mod decorator;
pub mod device;
pub mod fusion;
pub mod host_data;
pub mod kernels;
pub mod launch;
pub mod profile;
mod typecast;

pub use decorator::Parallel;
pub use decorator::reads::blocking_reads;

/// The unit tests' heap, counted where a test asserts what was (not) allocated.
#[cfg(test)]
#[global_allocator]
static TEST_HEAP: alloc::CountingAlloc = alloc::CountingAlloc::new();

use collective::CollectiveBackend;
use kernels::attention::FusedAttentionBackend;
use kernels::bias_gelu::FusedBiasGeluBackend;
use kernels::cross_entropy::FusedCrossEntropyBackend;
use kernels::layer_norm::FusedLayerNormBackend;
use kernels::rope::FusedRopeBackend;
use kernels::swiglu::FusedSwigluBackend;

/// What the decorator gives a backend: collectives and fused kernels. `Parallel<B>` and
/// `Autodiff<Parallel<B>>` are decorated backends; a model written for one runs on both.
pub trait DecoratedBackend:
    CollectiveBackend
    + FusedAttentionBackend
    + FusedBiasGeluBackend
    + FusedCrossEntropyBackend
    + FusedLayerNormBackend
    + FusedRopeBackend
    + FusedSwigluBackend
{
}

impl<B> DecoratedBackend for B where
    B: CollectiveBackend
        + FusedAttentionBackend
        + FusedBiasGeluBackend
        + FusedCrossEntropyBackend
        + FusedLayerNormBackend
        + FusedRopeBackend
        + FusedSwigluBackend
{
}
