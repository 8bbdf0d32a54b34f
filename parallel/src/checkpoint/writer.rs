//! Checkpoints written while training goes on (`checkpoint.async = true`).
//!
//! At a save every rank copies what it writes to host memory (a [`Snapshot`]) and rank 0
//! creates the staging directory; then each rank's writer thread writes its shard while the
//! rank trains on. The collectives of a synchronous save would run beside the training's own on
//! the same group, so the writers meet in the staging directory instead: each rank other than 0
//! leaves its shard's manifest entry there (`.rank-NNNNN.entry`, written whole by a rename), or
//! its error, and rank 0's writer waits for every entry (up to the group's communication
//! deadline), commits and prunes. A crash anywhere before the commit leaves the previous
//! checkpoint the newest committed one, as a synchronous save does.
//!
//! The next save, and the last (which is synchronous), first wait for the write in flight:
//! every rank joins its writer and the ranks exchange the outcomes, so a write that failed on
//! any rank fails the run on every rank, naming it.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use wildfire_backend::comm::ProcessGroup;

use super::crash::{CrashPoint, crash_point};
use super::distributed::{Snapshot, outcome, stage};
use super::store::{self, CheckpointError, FileEntry};

/// A rank's checkpoint writer thread, and the write it has in flight.
#[derive(Debug, Default)]
pub struct BackgroundWriter {
    pending: Option<(u64, JoinHandle<Result<(), String>>)>,
}

impl BackgroundWriter {
    /// Starts writing `snapshot` under `root` in the background, after waiting for the write
    /// in flight ([`Self::wait`]); rank 0 keeps the newest `keep_last` checkpoints (0: all).
    /// Every rank of `world` calls this.
    pub fn start(
        &mut self,
        root: &Path,
        snapshot: Snapshot,
        world: &ProcessGroup,
        keep_last: usize,
    ) -> Result<(), CheckpointError> {
        self.wait(world)?;
        let step = snapshot.step;
        let job = Job {
            root: root.to_path_buf(),
            staging: stage(root, world, step)?,
            rank: world.rank(),
            ranks: world.size(),
            deadline: world.options().timeout,
            keep_last,
        };
        let thread = std::thread::Builder::new()
            .name(format!("checkpoint-{step}"))
            .spawn(move || job.run(snapshot))
            .map_err(|e| CheckpointError::Rank {
                who: format!("rank {}", world.rank()),
                reason: format!("cannot start the checkpoint writer thread: {e}"),
            })?;
        self.pending = Some((step, thread));
        Ok(())
    }

    /// Waits for the write in flight, if any, and fails if it failed on any rank of `world`
    /// (naming it). Every rank calls this at the same point of the run.
    pub fn wait(&mut self, world: &ProcessGroup) -> Result<(), CheckpointError> {
        let Some((step, thread)) = self.pending.take() else {
            return Ok(());
        };
        let result = joined(thread).map_err(|e| format!("the checkpoint of step {step}: {e}"));
        for (rank, result) in world.all_gather_json(&result)?.into_iter().enumerate() {
            outcome(result, &format!("rank {rank}"))?;
        }
        Ok(())
    }

    /// Waits for the write in flight without the other ranks (when the run stopped at an
    /// error, and they may not come): its error, if it failed here.
    pub fn wait_alone(&mut self) -> Option<CheckpointError> {
        let (step, thread) = self.pending.take()?;
        let error = joined(thread).err()?;
        Some(CheckpointError::Rank {
            who: "this rank".into(),
            reason: format!("the checkpoint of step {step}: {error}"),
        })
    }
}

fn joined(thread: JoinHandle<Result<(), String>>) -> Result<(), String> {
    thread
        .join()
        .unwrap_or_else(|_| Err("the checkpoint writer thread panicked".into()))
}

/// One rank's part of a background write.
struct Job {
    root: PathBuf,
    staging: PathBuf,
    rank: usize,
    ranks: usize,
    /// How long rank 0 waits for the other ranks' entries.
    deadline: Duration,
    keep_last: usize,
}

impl Job {
    fn run(self, snapshot: Snapshot) -> Result<(), String> {
        let step = snapshot.step;
        crash_point(CrashPoint::BeforeShard, step, self.rank);
        let written = store::write_shard(&self.staging, self.rank, &snapshot.slices)
            .map_err(|e| e.to_string());
        if self.rank != 0 {
            self.publish(&written)?;
            return written.map(drop);
        }
        let mut files = vec![written?];
        for rank in 1..self.ranks {
            files.push(self.entry_of(rank)?);
        }
        crash_point(CrashPoint::BeforeCommit, step, 0);
        store::commit(
            &self.root,
            &self.staging,
            step,
            self.ranks,
            files,
            snapshot.state,
        )
        .map_err(|e| e.to_string())?;
        prune(&self.root, self.keep_last);
        Ok(())
    }

    fn entry_path(&self, rank: usize) -> PathBuf {
        self.staging.join(format!(".rank-{rank:05}.entry"))
    }

    /// Leaves this rank's outcome where rank 0 looks for it, whole (written, then renamed).
    fn publish(&self, written: &Result<FileEntry, String>) -> Result<(), String> {
        let path = self.entry_path(self.rank);
        let partial = path.with_extension("partial");
        let json = serde_json::to_vec(written).map_err(|e| e.to_string())?;
        std::fs::write(&partial, json)
            .and_then(|()| std::fs::rename(&partial, &path))
            .map_err(|e| format!("cannot leave its entry at {}: {e}", path.display()))
    }

    /// Rank `rank`'s shard entry, once it has left it (removed after reading, so the committed
    /// directory holds the manifest's files only); its error, or a timeout, naming it.
    fn entry_of(&self, rank: usize) -> Result<FileEntry, String> {
        let path = self.entry_path(rank);
        let started = Instant::now();
        while !path.exists() {
            if started.elapsed() > self.deadline {
                return Err(format!(
                    "rank {rank} did not write its shard within {:.0} s",
                    self.deadline.as_secs_f64()
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let read = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let _ = std::fs::remove_file(&path);
        let written: Result<FileEntry, String> = serde_json::from_slice(&read)
            .map_err(|e| format!("{}: unreadable entry: {e}", path.display()))?;
        written.map_err(|e| format!("rank {rank}: {e}"))
    }
}

/// Never dropped with a write in flight unnoticed: a run that ends normally waits first.
impl Drop for BackgroundWriter {
    fn drop(&mut self) {
        if let Some(error) = self.wait_alone() {
            eprintln!("warning: {error}");
        }
    }
}

/// Keeps the newest `keep_last` committed checkpoints under `root` (0 keeps all). Pruning is
/// rank 0's alone, and failing it only warns: it must not stop rank 0 while the others go on.
pub fn prune(root: &Path, keep_last: usize) {
    if keep_last == 0 {
        return;
    }
    if let Err(error) = store::prune(root, keep_last) {
        eprintln!("warning: old checkpoints were not pruned: {error}");
    }
}
