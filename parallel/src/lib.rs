//! wildfire's parallel strategies, built on [`wildfire_backend::comm`]: the layout of a job and
//! its validation ([`mesh`]), data parallelism ([`dp`]: DDP's bucketed gradient reduction),
//! ZeRO stages 1–3 and offload ([`fsdp`]), pipeline parallelism ([`pp`]: partition,
//! schedules as checked data, executor), tensor and sequence parallelism ([`tp`]: the layers
//! and the plan that applies them to a model), and mixed precision ([`precision`]: fp16 loss
//! scaling; the recipe does not use it yet).

pub mod dp;
pub mod fsdp;
pub mod mesh;
pub mod pp;
pub mod precision;
pub mod tp;

pub use wildfire_backend::comm::ProcessGroup;
