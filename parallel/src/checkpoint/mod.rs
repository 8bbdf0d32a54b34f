//! Sharded checkpoints: the store ([`store`]: per-rank safetensors files of tensor slices, a
//! manifest with every file's sha256, a commit marker written last) and the geometry of slices
//! ([`slices`]: a tensor-parallel rank's part as boxes of the whole tensor, and whole tensors
//! joined from the boxes any layout wrote), so a checkpoint saved under one layout loads under
//! another; and any module's parameters saved and loaded that way ([`module`]), with Burn's
//! Adam and AdamW moments ([`optimizer`]) and ZeRO's sharded state ([`zero`]). A checkpoint of
//! many ranks is written by all of them ([`distributed`]: each its shard, rank 0 the commit), or
//! in the background while training goes on ([`writer`]); [`crash`] lets a test kill a rank in
//! the middle of a write.

pub mod crash;
pub mod distributed;
pub mod module;
pub mod optimizer;
pub mod slices;
pub mod store;
pub mod writer;
pub mod zero;

pub use distributed::Snapshot;
pub use writer::{BackgroundWriter, prune};
