//! Writing one checkpoint from many ranks: rank 0 creates the staging directory, every rank
//! writes its own shard into it, and rank 0 commits once all shards are written. Every rank
//! learns the outcome, so a failed write on any rank fails the checkpoint on all of them (with
//! the rank named) instead of leaving them waiting. (The background writer, `writer`, does the
//! same with files in the staging directory instead of collectives.)

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::Serialize;
use serde::de::DeserializeOwned;
use wildfire_backend::comm::{HostTensor, ProcessGroup};

use super::Snapshot;
use super::crash::{CrashPoint, crash_point};
use super::store::{self, FileEntry};

/// Writes this rank's shard of `snapshot` under `root` and returns the committed directory.
/// Every rank of `world` calls this.
pub(super) fn save(
    root: &Path,
    world: &ProcessGroup,
    snapshot: Snapshot,
) -> anyhow::Result<PathBuf> {
    let (step, rank) = (snapshot.step, world.rank());
    let staging = stage(root, world, step)?;
    crash_point(CrashPoint::BeforeShard, step, rank);
    let written = store::write_shard(&staging, rank, &snapshot.slices).map_err(|e| e.to_string());
    let mut files = Vec::with_capacity(world.size());
    for (rank, entry) in all_gather_json(world, &written)?.into_iter().enumerate() {
        files.push(outcome::<FileEntry>(entry, &format!("rank {rank}"))?);
    }
    let committed = (rank == 0).then(|| {
        crash_point(CrashPoint::BeforeCommit, step, 0);
        store::commit(root, &staging, step, world.size(), files, snapshot.state)
            .map_err(|e| e.to_string())
    });
    let dir = outcome(broadcast_json(world, committed.as_ref())?, "rank 0")?;
    Ok(dir)
}

/// The staging directory of the checkpoint of `step` under `root`: rank 0 creates it and tells
/// every rank of `world`.
pub(super) fn stage(root: &Path, world: &ProcessGroup, step: u64) -> anyhow::Result<PathBuf> {
    let staging =
        (world.rank() == 0).then(|| store::create_staging(root, step).map_err(|e| e.to_string()));
    outcome(broadcast_json(world, staging.as_ref())?, "rank 0")
}

/// A rank's result, as an error naming that rank when it failed.
pub(super) fn outcome<T>(result: Result<T, String>, who: &str) -> anyhow::Result<T> {
    match result {
        Ok(value) => Ok(value),
        Err(error) => bail!("checkpoint write failed on {who}: {error}"),
    }
}

fn bytes_tensor(bytes: Vec<u8>) -> HostTensor<u8> {
    let len = bytes.len();
    HostTensor::new(bytes, vec![len])
}

/// Every rank's `value`, in rank order (as JSON through the group).
pub(super) fn all_gather_json<T: Serialize + DeserializeOwned>(
    world: &ProcessGroup,
    value: &T,
) -> anyhow::Result<Vec<T>> {
    let bytes = serde_json::to_vec(value)?;
    let lengths = world.all_gather_host(HostTensor::new(vec![bytes.len() as i64], vec![1]), 0)?;
    let joined = world.all_gather_host(bytes_tensor(bytes), 0)?;
    let mut start = 0;
    lengths
        .data
        .iter()
        .map(|&len| {
            let part = &joined.data[start..start + len as usize];
            start += len as usize;
            serde_json::from_slice(part).context("a rank sent an unreadable checkpoint message")
        })
        .collect()
}

/// Rank 0's `value` on every rank (`value` is `None` elsewhere).
fn broadcast_json<T: Serialize + DeserializeOwned>(
    world: &ProcessGroup,
    value: Option<&T>,
) -> anyhow::Result<T> {
    let bytes = value
        .map(serde_json::to_vec)
        .transpose()?
        .unwrap_or_default();
    let len = world.broadcast_host(HostTensor::new(vec![bytes.len() as i64], vec![1]), 0)?;
    let mut padded = bytes;
    padded.resize(len.data[0] as usize, 0);
    let shared = world.broadcast_host(bytes_tensor(padded), 0)?;
    serde_json::from_slice(&shared.data).context("rank 0 sent an unreadable checkpoint message")
}
