//! wildfire's parallel strategies, built on [`wildfire_backend::comm`]: the layout of a job and
//! its validation ([`mesh`]), data parallelism ([`dp`]: DDP's bucketed gradient reduction),
//! ZeRO stages 1–3 and offload ([`fsdp`]) and pipeline parallelism ([`pp`]: partition,
//! schedules as checked data, executor). Tensor parallelism follows in a later issue.

pub mod dp;
pub mod fsdp;
pub mod mesh;
pub mod pp;

pub use wildfire_backend::comm::ProcessGroup;
