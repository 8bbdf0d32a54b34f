//! What a pipeline step measured on every pipeline rank, beside the schedule's theory: the
//! measured bubble `1 − busy / wall` and the most activations each rank held at once.

use serde::Serialize;
use wildfire_backend::comm::{CommError, ProcessGroup};

use super::StepStats;
use crate::mesh::PipelinePlan;

/// One step of a pipeline, every rank's figures (index = pipeline rank).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PipelineReport {
    /// Idle time / step time, per pipeline rank.
    pub bubble: Vec<f64>,
    /// The schedule's ideal bubble: (p−1)/(m+p−1), or (p−1)/(v·m+p−1) interleaved.
    pub bubble_theory: f64,
    /// Most stored activations (forwards awaiting their backward), per pipeline rank.
    pub peak_activations: Vec<usize>,
}

impl PipelineReport {
    /// Every rank of `pipe` gathers every rank's `stats` (a collective over `pipe`); `None`
    /// without a pipeline (one rank, one chunk), where nothing is idle.
    pub fn gather(
        stats: &StepStats,
        pipe: &ProcessGroup,
        plan: &PipelinePlan,
    ) -> Result<Option<Self>, CommError> {
        if pipe.size() == 1 && plan.schedule.virtual_stages == 1 {
            return Ok(None);
        }
        let rows = pipe.all_gather_values(&[stats.bubble(), stats.peak_activations as f64])?;
        Ok(Some(Self {
            bubble: rows.iter().map(|row| row[0]).collect(),
            bubble_theory: plan.ideal_bubble,
            peak_activations: rows.iter().map(|row| row[1] as usize).collect(),
        }))
    }

    /// The largest bubble over the ranks.
    pub fn worst_bubble(&self) -> f64 {
        self.bubble.iter().copied().fold(0.0, f64::max)
    }
}
