//! wildfire's backend layer: collective communication for Burn tensors on every backend
//! ([`comm`]), the backend decorator [`Parallel<B>`], fused kernels ([`kernels`]), and the
//! process launcher behind `wildfire launch` ([`launch`]).

pub mod collective;
pub mod comm;
mod decorator;
pub mod kernels;
pub mod launch;

pub use decorator::Parallel;
