//! Where a run's numbers go: burn-train metrics (shown by its TUI in a terminal, or by
//! [`LogRenderer`] as plain lines otherwise), a TensorBoard event file and `metrics.jsonl`.

mod metrics;
mod render;
mod sink;
pub mod tensorboard;

pub use metrics::{Bubble, GradNorm, Loss, Mfu, StepOutput, StepScalar, TokensPerSec};
pub use render::LogRenderer;
pub use sink::{LossScaleRecord, MetricsSink, StepRecord};
