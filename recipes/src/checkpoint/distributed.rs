//! Writing one checkpoint from many ranks: rank 0 creates the staging directory, every rank
//! writes its own shard into it, and rank 0 commits once all shards are written. Every rank
//! learns the outcome, so a failed write on any rank fails the checkpoint on all of them (with
//! the rank named) instead of leaving them waiting.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::Serialize;
use serde::de::DeserializeOwned;
use wildfire_backend::comm::{HostTensor, ProcessGroup};

use super::store::{self, FileEntry, TensorSlice};

/// Writes this rank's `slices` as its shard of the checkpoint of `state` (whose `step` names
/// it) under `root`, and returns the committed directory. Every rank of `world` calls this.
pub(super) fn save(
    root: &Path,
    world: &ProcessGroup,
    slices: &[TensorSlice],
    state: serde_json::Value,
) -> anyhow::Result<PathBuf> {
    let step = state["step"].as_u64().unwrap_or_default();
    let staging =
        (world.rank() == 0).then(|| store::create_staging(root, step).map_err(|e| e.to_string()));
    let staging: PathBuf = outcome(broadcast_json(world, staging.as_ref())?, "rank 0")?;
    let written = store::write_shard(&staging, world.rank(), slices).map_err(|e| e.to_string());
    let mut files = Vec::with_capacity(world.size());
    for (rank, entry) in all_gather_json(world, &written)?.into_iter().enumerate() {
        files.push(outcome::<FileEntry>(entry, &format!("rank {rank}"))?);
    }
    let committed = (world.rank() == 0).then(|| {
        store::commit(root, &staging, step, world.size(), files, state).map_err(|e| e.to_string())
    });
    let dir = outcome(broadcast_json(world, committed.as_ref())?, "rank 0")?;
    Ok(dir)
}

/// A rank's result, as an error naming that rank when it failed.
fn outcome<T>(result: Result<T, String>, who: &str) -> anyhow::Result<T> {
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
