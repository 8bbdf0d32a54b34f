//! wildfire's parallel strategies, built on [`wildfire_backend::comm`]: the layout of a job and
//! its validation ([`mesh`]), data parallelism ([`dp`]: DDP's bucketed gradient reduction),
//! ZeRO stages 1–3 and offload ([`fsdp`]), pipeline parallelism ([`pp`]: partition,
//! schedules as checked data, executor) and the tensor-parallel layers ([`tp`]; the GPT recipe
//! does not use them yet).

pub mod dp;
pub mod fsdp;
pub mod mesh;
pub mod pp;
pub mod tp;

pub use wildfire_backend::comm::ProcessGroup;
