//! wildfire's backend layer: collective communication for Burn tensors on every backend
//! ([`comm`]), and the process launcher behind `wildfire launch` ([`launch`]).

pub mod comm;
pub mod launch;
