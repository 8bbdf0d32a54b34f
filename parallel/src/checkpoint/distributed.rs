//! Writing one checkpoint from many ranks: rank 0 creates the staging directory, every rank
//! writes its own shard into it, and rank 0 commits once all shards are written. Every rank
//! learns the outcome, so a failed write on any rank fails the checkpoint on all of them (with
//! the rank named) instead of leaving them waiting. (The background writer, [`super::writer`],
//! does the same with files in the staging directory instead of collectives.)

use std::path::{Path, PathBuf};

use wildfire_backend::comm::ProcessGroup;

use super::crash::{CrashPoint, crash_point};
use super::store::{self, CheckpointError, FileEntry, TensorSlice};

/// What one rank writes of a checkpoint: the step, this rank's slices, and the checkpoint's
/// state (the manifest's; only rank 0's is written, the same on every rank).
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub step: u64,
    pub slices: Vec<TensorSlice>,
    pub state: serde_json::Value,
}

impl Snapshot {
    /// Writes this rank's shard under `root`; rank 0 commits once every rank of `world` has
    /// written its own. Every rank calls this and learns the outcome: the committed directory.
    pub fn write(self, root: &Path, world: &ProcessGroup) -> Result<PathBuf, CheckpointError> {
        let (step, rank) = (self.step, world.rank());
        if world.size() == 1 {
            crash_point(CrashPoint::BeforeShard, step, 0);
            crash_point(CrashPoint::BeforeCommit, step, 0);
            let shards = [(0, self.slices)];
            return store::write_checkpoint(root, step, &shards, self.state);
        }
        let staging = stage(root, world, step)?;
        crash_point(CrashPoint::BeforeShard, step, rank);
        let written = store::write_shard(&staging, rank, &self.slices).map_err(|e| e.to_string());
        let mut files = Vec::with_capacity(world.size());
        for (rank, entry) in world.all_gather_json(&written)?.into_iter().enumerate() {
            files.push(outcome::<FileEntry>(entry, &format!("rank {rank}"))?);
        }
        let committed = (rank == 0).then(|| {
            crash_point(CrashPoint::BeforeCommit, step, 0);
            store::commit(root, &staging, step, world.size(), files, self.state)
                .map_err(|e| e.to_string())
        });
        outcome(world.broadcast_json(committed.as_ref())?, "rank 0")
    }
}

/// The staging directory of the checkpoint of `step` under `root`: rank 0 creates it and tells
/// every rank of `world`.
pub fn stage(root: &Path, world: &ProcessGroup, step: u64) -> Result<PathBuf, CheckpointError> {
    let staging =
        (world.rank() == 0).then(|| store::create_staging(root, step).map_err(|e| e.to_string()));
    outcome(world.broadcast_json(staging.as_ref())?, "rank 0")
}

/// A rank's result, as an error naming that rank when it failed.
pub fn outcome<T>(result: Result<T, String>, who: &str) -> Result<T, CheckpointError> {
    result.map_err(|reason| CheckpointError::Rank {
        who: who.to_string(),
        reason,
    })
}
