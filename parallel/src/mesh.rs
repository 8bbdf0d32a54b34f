//! The parallel layout of a job, and the one place that checks it: `world = dp × tp × pp`, the
//! pipeline's stages against the model's layers, and the schedule (built and statically checked
//! before any training).
//!
//! Rank grid: row-major over (dp, pp, tp) with tp fastest, so tensor-parallel peers are
//! neighbours (as GPUs of one node are). Data and tensor parallelism arrive with their own
//! issues; until then `dp` and `tp` must be 1.

use std::ops::Range;

use crate::pp::{
    CheckError, PartitionError, Schedule, ScheduleError, ScheduleKind, check, partition,
};

/// Degrees of parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelDims {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
}

/// Why a layout cannot run, with every number involved.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error(
        "the world has {world} ranks, but dp {dp} × tp {tp} × pp {pp} = {product}: start \
         {product} ranks (`wildfire launch --nproc-per-node {product} -- …`, or `--transport \
         local` for threads) or change the degrees"
    )]
    World {
        world: usize,
        dp: usize,
        tp: usize,
        pp: usize,
        product: usize,
    },
    #[error("{what} = {value} is not supported yet (only 1): {why}")]
    NotYet {
        what: &'static str,
        value: usize,
        why: &'static str,
    },
    #[error("{0}")]
    Partition(#[from] PartitionError),
    #[error("{0}")]
    Schedule(#[from] ScheduleError),
    #[error("the {kind} schedule failed its static check, so it was not run: {source}")]
    Check {
        kind: ScheduleKind,
        source: Box<CheckError>,
    },
}

/// A checked pipeline: the blocks of every stage and the schedule every rank runs.
#[derive(Debug, Clone)]
pub struct PipelinePlan {
    /// Layer range of each global stage (`pp · virtual_stages` of them).
    pub stages: Vec<Range<usize>>,
    pub schedule: Schedule,
    /// Peak in-flight activations per rank, from the checker's simulation.
    pub peak_in_flight: Vec<usize>,
    /// The schedule's bubble with equal stages and free communication, from the checker's timed
    /// simulation: `(p−1)/(m+p−1)`, or `(p−1)/(v·m+p−1)` interleaved with `p | m`, and what the
    /// padded interleaved schedule really idles otherwise.
    pub ideal_bubble: f64,
}

impl ParallelDims {
    /// Checks the degrees against a world of `world` ranks.
    pub fn validate(&self, world: usize) -> Result<(), MeshError> {
        let product = self.dp * self.tp * self.pp;
        if product != world || product == 0 {
            return Err(MeshError::World {
                world,
                dp: self.dp,
                tp: self.tp,
                pp: self.pp,
                product,
            });
        }
        for (what, value, why) in [
            ("dp", self.dp, "data parallelism is not implemented yet"),
            ("tp", self.tp, "tensor parallelism is not implemented yet"),
        ] {
            if value != 1 {
                return Err(MeshError::NotYet { what, value, why });
            }
        }
        Ok(())
    }

    /// `global`'s coordinates `(dp, pp, tp)` in the rank grid.
    pub fn coordinates(&self, global: usize) -> (usize, usize, usize) {
        let tp = global % self.tp;
        let pp = global / self.tp % self.pp;
        (global / (self.tp * self.pp), pp, tp)
    }

    /// The pipeline for a model of `layers` layers: its stages (even, or `stage_layers` when not
    /// empty) and its schedule, built and proven deadlock-free by the static checker.
    pub fn pipeline(
        &self,
        kind: ScheduleKind,
        virtual_stages: usize,
        microbatches: usize,
        layers: usize,
        stage_layers: &[usize],
    ) -> Result<PipelinePlan, MeshError> {
        let schedule = Schedule::build(kind, self.pp, virtual_stages, microbatches)?;
        let list = (!stage_layers.is_empty()).then_some(stage_layers);
        let stages = partition(layers, self.pp, virtual_stages, list)?;
        let report = check(&schedule).map_err(|source| MeshError::Check {
            kind,
            source: Box::new(source),
        })?;
        Ok(PipelinePlan {
            stages,
            schedule,
            ideal_bubble: report.simulated_bubble(),
            peak_in_flight: report.peak_in_flight,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn world_must_be_the_product() {
        let dims = ParallelDims {
            dp: 1,
            tp: 1,
            pp: 4,
        };
        assert!(dims.validate(4).is_ok());
        assert_eq!(
            dims.validate(2).unwrap_err().to_string(),
            "the world has 2 ranks, but dp 1 × tp 1 × pp 4 = 4: start 4 ranks (`wildfire launch \
             --nproc-per-node 4 -- …`, or `--transport local` for threads) or change the degrees"
        );
        let dp = ParallelDims { dp: 2, ..dims };
        assert_eq!(
            dp.validate(8).unwrap_err().to_string(),
            "dp = 2 is not supported yet (only 1): data parallelism is not implemented yet"
        );
    }

    #[test]
    fn the_grid_has_tp_fastest() {
        let dims = ParallelDims {
            dp: 2,
            tp: 2,
            pp: 3,
        };
        assert_eq!(dims.coordinates(0), (0, 0, 0));
        assert_eq!(dims.coordinates(1), (0, 0, 1));
        assert_eq!(dims.coordinates(2), (0, 1, 0));
        assert_eq!(dims.coordinates(7), (1, 0, 1));
    }

    #[test]
    fn a_pipeline_is_partitioned_and_checked() {
        let dims = ParallelDims {
            dp: 1,
            tp: 1,
            pp: 2,
        };
        let plan = dims
            .pipeline(ScheduleKind::Interleaved, 2, 4, 4, &[])
            .unwrap();
        assert_eq!(plan.stages, [0..1, 1..2, 2..3, 3..4]);
        assert_eq!(plan.peak_in_flight.len(), 2);
        let err = dims
            .pipeline(ScheduleKind::OneFOneB, 1, 4, 1, &[])
            .unwrap_err();
        assert!(err.to_string().contains("over 1 layers"), "{err}");
    }
}
