//! The parallel layout of a job, and the one place that checks it: `world = dp × tp × pp`, the
//! ZeRO stage and sequence parallelism against the other degrees, the pipeline's stages against
//! the model's layers, and the schedule (built and statically checked before any training).
//! [`Mesh`] is a checked layout with every process group of a rank, created once.
//!
//! Rank grid: row-major over (dp, pp, tp) with tp fastest, so tensor-parallel peers are
//! neighbours (as GPUs of one node are).

use std::ops::Range;

use wildfire_backend::comm::{CommError, CommOptions, LaunchEnv, LaunchFlags, ProcessGroup};

use crate::fsdp::ZeroStage;
use crate::pp::{
    CheckError, PartitionError, Schedule, ScheduleError, ScheduleKind, check, partition,
};

/// Degrees of parallelism, and what the data-parallel ranks shard (the ZeRO stage) and whether
/// tensor-parallel ranks also split the sequence between their layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelDims {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    pub zero: ZeroStage,
    pub sequence_parallel: bool,
}

impl Default for ParallelDims {
    /// One rank: no parallelism.
    fn default() -> Self {
        Self {
            dp: 1,
            tp: 1,
            pp: 1,
            zero: ZeroStage::Replicated,
            sequence_parallel: false,
        }
    }
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
    #[error(
        "ZeRO stage 3 with tensor parallelism (tp {tp}) is not supported yet: its units gather \
         whole parameters; use ZeRO stage 1 or 2 with tp > 1"
    )]
    ZeroWithTensor { tp: usize },
    #[error(
        "the global batch is {global} sequences, but micro-batch {micro} × accumulation \
         {accumulation} × dp {dp} = {product}: change one of them (or leave the global batch \
         unset and it is that product)"
    )]
    Batch {
        global: usize,
        micro: usize,
        accumulation: usize,
        dp: usize,
        product: usize,
    },
    #[error(
        "ZeRO stage 3 shards the parameters of the pipeline stage a rank holds and needs pp = 1 \
         (as DeepSpeed's pipeline engine does), but pp = {pp}: use ZeRO stage 1 or 2 with \
         pipeline parallelism"
    )]
    ZeroWithPipeline { pp: usize },
    #[error(
        "tensor parallelism splits attention by heads, but {heads} heads do not divide by tp \
         {tp}: choose a tp that divides {heads}"
    )]
    Heads { heads: usize, tp: usize },
    #[error(
        "sequence parallelism splits the sequence, but length {seq} does not divide by tp {tp}: \
         choose a context that is a multiple of {tp}"
    )]
    Sequence { seq: usize, tp: usize },
    #[error(
        "sequence parallelism splits the sequence between tensor-parallel layers, but tp = 1: \
         set tp > 1 or leave sequence parallelism off"
    )]
    SequenceWithoutTensor,
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Partition(#[from] PartitionError),
    #[error(transparent)]
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
    /// Data parallelism alone: `dp` replicas (or shards, by `zero`) of the whole model.
    pub fn data(dp: usize, zero: ZeroStage) -> Self {
        Self {
            dp,
            zero,
            ..Self::default()
        }
    }

    /// Checks the layout against a world of `world` ranks: the degrees' product, the ZeRO stage
    /// against tensor and pipeline parallelism, and sequence parallelism against tp.
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
        if self.sequence_parallel && self.tp == 1 {
            return Err(MeshError::SequenceWithoutTensor);
        }
        self.check_zero(self.zero)
    }

    /// Checks tensor parallelism against the model: the heads (and, under sequence
    /// parallelism, the sequence length) must divide by `tp`. The vocabulary need not: the
    /// vocabulary-parallel layers split it unevenly (`split_ranges`), without padding.
    pub fn check_tensor_parallel(&self, heads: usize, seq: usize) -> Result<(), MeshError> {
        let tp = self.tp;
        if self.sequence_parallel && tp == 1 {
            return Err(MeshError::SequenceWithoutTensor);
        }
        if !heads.is_multiple_of(tp) {
            return Err(MeshError::Heads { heads, tp });
        }
        if self.sequence_parallel && !seq.is_multiple_of(tp) {
            return Err(MeshError::Sequence { seq, tp });
        }
        Ok(())
    }

    /// Checks a ZeRO stage against the layout.
    pub fn check_zero(&self, stage: ZeroStage) -> Result<(), MeshError> {
        if stage == ZeroStage::ShardParameters && self.pp > 1 {
            return Err(MeshError::ZeroWithPipeline { pp: self.pp });
        }
        if stage == ZeroStage::ShardParameters && self.tp > 1 {
            return Err(MeshError::ZeroWithTensor { tp: self.tp });
        }
        Ok(())
    }

    /// The global batch (sequences per optimizer step): `micro × accumulation × dp`, which
    /// `global`, when given, must equal.
    pub fn global_batch(
        &self,
        global: Option<usize>,
        micro: usize,
        accumulation: usize,
    ) -> Result<usize, MeshError> {
        let product = micro * accumulation * self.dp;
        match global {
            Some(global) if global != product => Err(MeshError::Batch {
                global,
                micro,
                accumulation,
                dp: self.dp,
                product,
            }),
            _ => Ok(product),
        }
    }

    /// The global ranks of `global`'s pipeline (same dp and tp coordinates), in stage order.
    pub fn pipeline_ranks(&self, global: usize) -> Vec<usize> {
        let (dp, _, tp) = self.coordinates(global);
        (0..self.pp)
            .map(|pp| (dp * self.pp + pp) * self.tp + tp)
            .collect()
    }

    /// The global ranks of `global`'s data-parallel group (same pp and tp coordinates), in dp
    /// order.
    pub fn data_ranks(&self, global: usize) -> Vec<usize> {
        let (_, pp, tp) = self.coordinates(global);
        (0..self.dp)
            .map(|dp| (dp * self.pp + pp) * self.tp + tp)
            .collect()
    }

    /// The global ranks of `global`'s tensor-parallel group (same dp and pp coordinates), in tp
    /// order.
    pub fn tensor_ranks(&self, global: usize) -> Vec<usize> {
        let first = global - global % self.tp;
        (first..first + self.tp).collect()
    }

    /// The global ranks that hold one replica of the model between them (same dp coordinate:
    /// every pipeline stage and tensor-parallel part), in rank order.
    pub fn model_ranks(&self, global: usize) -> Vec<usize> {
        let size = self.pp * self.tp;
        let first = global - global % size;
        (first..first + size).collect()
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

/// A checked layout and this rank's process groups, each created once, in the same order on
/// every rank (so their rendezvous keys match).
#[derive(Debug, Clone)]
pub struct Mesh {
    dims: ParallelDims,
    world: ProcessGroup,
    pipeline: ProcessGroup,
    data: ProcessGroup,
    tensor: ProcessGroup,
    replica: ProcessGroup,
}

impl Mesh {
    /// Validates `dims` against `world` and creates this rank's groups.
    pub fn new(world: ProcessGroup, dims: ParallelDims) -> Result<Self, MeshError> {
        dims.validate(world.size())?;
        let rank = world.rank();
        let pipeline = world.subgroup(&dims.pipeline_ranks(rank))?;
        let data = world.subgroup(&dims.data_ranks(rank))?;
        let tensor = world.subgroup(&dims.tensor_ranks(rank))?;
        let replica = world.subgroup(&dims.model_ranks(rank))?;
        Ok(Self {
            dims,
            world,
            pipeline,
            data,
            tensor,
            replica,
        })
    }

    /// The mesh of a launched job (`wildfire launch`, torchrun or Slurm variables; one rank
    /// when there are none), with the communication options of the environment.
    pub fn from_env(dims: ParallelDims) -> Result<Self, MeshError> {
        let env = LaunchEnv::detect(&LaunchFlags::default())?;
        let world = ProcessGroup::init(&env, CommOptions::from_env()?)?;
        Self::new(world, dims)
    }

    /// One mesh per thread rank of this process (`dp · tp · pp` of them), in rank order.
    pub fn local(dims: ParallelDims, options: CommOptions) -> Result<Vec<Self>, MeshError> {
        let ranks = dims.dp * dims.tp * dims.pp;
        ProcessGroup::local_world(ranks.max(1), options)?
            .into_iter()
            .map(|world| Self::new(world, dims))
            .collect()
    }

    pub fn dims(&self) -> &ParallelDims {
        &self.dims
    }

    /// Every rank of the job.
    pub fn world(&self) -> &ProcessGroup {
        &self.world
    }

    /// This rank's pipeline (same dp and tp coordinates), in stage order.
    pub fn pipeline(&self) -> &ProcessGroup {
        &self.pipeline
    }

    /// This rank's data-parallel group (same pp and tp coordinates).
    pub fn data(&self) -> &ProcessGroup {
        &self.data
    }

    /// This rank's tensor-parallel group (same dp and pp coordinates).
    pub fn tensor(&self) -> &ProcessGroup {
        &self.tensor
    }

    /// The ranks that hold one model replica between them (pipeline stages × tensor-parallel
    /// parts).
    pub fn replica(&self) -> &ProcessGroup {
        &self.replica
    }

    /// The first and last stages of this rank's pipeline, which both hold a parameter the
    /// model ties between its ends (an input embedding reused as the output head), when the
    /// pipeline has more than one stage and this rank is one of the two; `None` otherwise.
    pub fn tie_group(&self) -> Result<Option<ProcessGroup>, MeshError> {
        let last = self.dims.pp - 1;
        let stage = self.pipeline.rank();
        if self.dims.pp == 1 || (stage != 0 && stage != last) {
            return Ok(None);
        }
        Ok(Some(self.pipeline.subgroup(&[0, last])?))
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
            ..ParallelDims::default()
        };
        assert!(dims.validate(4).is_ok());
        assert_eq!(
            dims.validate(2).unwrap_err().to_string(),
            "the world has 2 ranks, but dp 1 × tp 1 × pp 4 = 4: start 4 ranks (`wildfire launch \
             --nproc-per-node 4 -- …`, or `--transport local` for threads) or change the degrees"
        );
        assert!(ParallelDims { tp: 2, ..dims }.validate(8).is_ok());
        assert!(ParallelDims { dp: 2, ..dims }.validate(8).is_ok());
    }

    #[test]
    fn tensor_parallelism_needs_heads_and_sequence_divisible() {
        let dims = ParallelDims {
            dp: 1,
            tp: 4,
            pp: 1,
            ..ParallelDims::default()
        };
        let sequence = ParallelDims {
            sequence_parallel: true,
            ..dims
        };
        assert!(sequence.check_tensor_parallel(12, 128).is_ok());
        assert_eq!(
            dims.check_tensor_parallel(6, 128).unwrap_err().to_string(),
            "tensor parallelism splits attention by heads, but 6 heads do not divide by tp 4: \
             choose a tp that divides 6"
        );
        assert!(dims.check_tensor_parallel(12, 130).is_ok());
        assert_eq!(
            sequence
                .check_tensor_parallel(12, 130)
                .unwrap_err()
                .to_string(),
            "sequence parallelism splits the sequence, but length 130 does not divide by tp 4: \
             choose a context that is a multiple of 4"
        );
        let serial = ParallelDims { tp: 1, ..sequence };
        assert!(matches!(
            serial.check_tensor_parallel(12, 128),
            Err(MeshError::SequenceWithoutTensor)
        ));
        assert!(matches!(
            serial.validate(1),
            Err(MeshError::SequenceWithoutTensor)
        ));
        let zero3 = ParallelDims {
            zero: ZeroStage::ShardParameters,
            ..dims
        };
        assert_eq!(
            zero3.validate(4).unwrap_err().to_string(),
            "ZeRO stage 3 with tensor parallelism (tp 4) is not supported yet: its units gather \
             whole parameters; use ZeRO stage 1 or 2 with tp > 1"
        );
        assert!(dims.check_zero(ZeroStage::ShardGradients).is_ok());
        assert_eq!(
            dims.check_zero(ZeroStage::ShardParameters)
                .unwrap_err()
                .to_string(),
            "ZeRO stage 3 with tensor parallelism (tp 4) is not supported yet: its units gather \
             whole parameters; use ZeRO stage 1 or 2 with tp > 1"
        );
    }

    #[test]
    fn groups_follow_the_grid() {
        let dims = ParallelDims {
            dp: 2,
            tp: 1,
            pp: 3,
            ..ParallelDims::default()
        };
        assert_eq!(dims.pipeline_ranks(4), [3, 4, 5]);
        assert_eq!(dims.data_ranks(4), [1, 4]);
        assert_eq!(dims.data_ranks(0), [0, 3]);
        let grid = ParallelDims { tp: 2, ..dims };
        // Rank 9 is (dp 1, pp 1, tp 1).
        assert_eq!(grid.tensor_ranks(9), [8, 9]);
        assert_eq!(grid.pipeline_ranks(9), [7, 9, 11]);
        assert_eq!(grid.data_ranks(9), [3, 9]);
        assert_eq!(grid.model_ranks(9), [6, 7, 8, 9, 10, 11]);
    }

    #[test]
    fn the_global_batch_is_the_product_of_its_terms() {
        let dims = ParallelDims {
            dp: 4,
            tp: 1,
            pp: 1,
            ..ParallelDims::default()
        };
        assert_eq!(dims.global_batch(None, 8, 2).unwrap(), 64);
        assert_eq!(dims.global_batch(Some(64), 8, 2).unwrap(), 64);
        assert_eq!(
            dims.global_batch(Some(60), 8, 2).unwrap_err().to_string(),
            "the global batch is 60 sequences, but micro-batch 8 × accumulation 2 × dp 4 = 64: \
             change one of them (or leave the global batch unset and it is that product)"
        );
        assert!(dims.check_zero(ZeroStage::ShardParameters).is_ok());
        let piped = ParallelDims { pp: 2, ..dims };
        assert!(piped.check_zero(ZeroStage::ShardGradients).is_ok());
        assert!(
            piped
                .check_zero(ZeroStage::ShardParameters)
                .unwrap_err()
                .to_string()
                .contains("pp = 2")
        );
    }

    #[test]
    fn the_grid_has_tp_fastest() {
        let dims = ParallelDims {
            dp: 2,
            tp: 2,
            pp: 3,
            ..ParallelDims::default()
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
            ..ParallelDims::default()
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

#[cfg(test)]
mod mesh_tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_mesh_holds_every_group_of_its_rank() {
        let dims = ParallelDims {
            dp: 2,
            tp: 2,
            pp: 2,
            ..ParallelDims::default()
        };
        let options = CommOptions {
            timeout: Duration::from_secs(10),
            debug: false,
        };
        let meshes = Mesh::local(dims, options).unwrap();
        assert_eq!(meshes.len(), 8);
        // Rank 5 is (dp 1, pp 0, tp 1).
        let mesh = &meshes[5];
        assert_eq!(mesh.data().global_ranks(), [1, 5]);
        assert_eq!(mesh.tensor().global_ranks(), [4, 5]);
        assert_eq!(mesh.pipeline().global_ranks(), [5, 7]);
        assert_eq!(mesh.replica().global_ranks(), [4, 5, 6, 7]);
        assert_eq!(
            mesh.tie_group().unwrap().unwrap().global_ranks(),
            [5, 7],
            "a two-stage pipeline ties its only two stages"
        );
        let wrong = ParallelDims { dp: 3, ..dims };
        assert!(matches!(
            Mesh::new(meshes[0].world().clone(), wrong),
            Err(MeshError::World { product: 12, .. })
        ));
    }
}
