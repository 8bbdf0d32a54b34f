//! Sharded checkpoints: the store ([`store`]: per-rank safetensors files of tensor slices, a
//! manifest with every file's sha256, a commit marker written last) and the geometry of slices
//! ([`slices`]: a tensor-parallel rank's part as boxes of the whole tensor, and whole tensors
//! joined from the boxes any layout wrote), so a checkpoint saved under one layout loads under
//! another; and any module's parameters saved and loaded that way ([`module`]).

pub mod module;
pub mod slices;
pub mod store;
