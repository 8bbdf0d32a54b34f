//! wildfire's parallel strategies, built on [`wildfire_backend::comm`]: the layout of a job and
//! its validation ([`mesh`]) and pipeline parallelism ([`pp`]: partition, schedules as checked
//! data, executor). DDP, ZeRO/FSDP and tensor parallelism follow in later issues.

pub mod mesh;
pub mod pp;

pub use wildfire_backend::comm::ProcessGroup;
