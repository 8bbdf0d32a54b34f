//! wildfire's parallel strategies: the mesh (dp × tp × pp, ZeRO stage), DDP, ZeRO/FSDP, tensor and
//! pipeline parallelism. They are built on [`wildfire_backend::comm`] in the issues that follow;
//! this crate holds no code yet.

pub use wildfire_backend::comm::ProcessGroup;
