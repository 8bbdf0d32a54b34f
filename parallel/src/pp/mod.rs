//! Pipeline parallelism: schedules as data and the checker that proves them safe.
//!
//! [`partition`] cuts the model's layers into stages. A [`Schedule`] lists, for every pipeline rank, the forwards, backwards, sends and receives it
//! runs in one optimiser step ([`schedule`] explains the stage layout, the orders of GPipe, 1F1B
//! and interleaved 1F1B, and their activation bounds). [`check()`] verifies a schedule before any
//! training: matched sends and receives, backward after forward, no deadlock (all ranks
//! simulated) and bounded in-flight activations, and times it to measure its bubble.
//! [`run_step`] runs one rank's actions on its model chunks ([`PipelineChunk`]) for a training
//! step; [`run_forward`] runs micro-batches forward only (evaluation); [`PipelineReport`] gathers
//! every rank's measured bubble. A parameter two stages
//! share (a tied embedding) is a copy on each, and [`TiedCopies`] gives both the summed gradient.
//!
//! ```
//! use wildfire_parallel::pp::{Schedule, check};
//!
//! let schedule = Schedule::build("1f1b".parse()?, 4, 1, 8)?;
//! let report = check(&schedule)?;
//! assert_eq!(report.simulated_bubble(), schedule.theoretical_bubble()); // 3/11
//! assert_eq!(report.peak_in_flight, [4, 3, 2, 1]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod check;
pub mod executor;
pub mod partition;
pub mod report;
pub mod schedule;
pub mod tied;

pub use check::{At, CheckError, CheckReport, SendSemantics, check, check_with};
pub use executor::{
    PipelineChunk, PipelineError, StepResult, StepStats, graphs_lock, run_forward, run_step,
};
pub use partition::{PartitionError, partition};
pub use report::PipelineReport;
pub use schedule::{Action, Schedule, ScheduleError, ScheduleKind, theoretical_bubble};
pub use tied::TiedCopies;
