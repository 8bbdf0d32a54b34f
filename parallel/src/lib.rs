//! wildfire's parallel strategies for any Burn module, built on [`wildfire_backend::comm`]: the
//! layout of a job, its validation and its process groups ([`mesh`]), identical replicas at
//! start ([`replicas`]), data parallelism ([`dp`]: DDP's bucketed gradient reduction), ZeRO
//! stages 1–3 and offload ([`fsdp`]), global-norm clipping on the device ([`clip`]; the step's
//! scalars stay there: [`device_value`]), the optimizer step under
//! every stage ([`update`], and as the optimizer a burn-train `Learner` holds:
//! [`learner_update`]), burn-train learning strategies built on them ([`strategy`], with
//! checkpoints any stage resumes ([`moments`]), AdamW offloaded per tensor ([`offload`]) and the
//! gradient norm as a metric ([`grad_norm`])),
//! pipeline parallelism ([`pp`]: partition, schedules as checked data, executor), tensor and
//! sequence parallelism ([`tp`]: the parallel-aware layers and the plan that splits any module that
//! uses them), one rank's forward and backward passes whatever splits its replica ([`split`]),
//! module paths ([`paths`]), gradients summed over a group ([`grad_sum`]), and
//! mixed precision ([`precision`]: fp16 loss scaling), and sharded checkpoints ([`checkpoint`]:
//! the store and the geometry that reshards them).

pub mod checkpoint;
pub mod clip;
pub mod device_value;
pub mod dp;
pub mod fsdp;
pub mod grad_norm;
pub mod grad_sum;
pub mod learner_update;
pub mod mesh;
pub mod moments;
pub mod offload;
pub mod paths;
pub mod pp;
pub mod precision;
pub mod replicas;
pub mod split;
pub mod strategy;
pub mod tp;
pub mod update;

pub use mesh::{Mesh, ParallelDims};
pub use strategy::DataParallel;

pub use wildfire_backend::comm::ProcessGroup;
