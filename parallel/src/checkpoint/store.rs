//! Sharded, atomic, verified checkpoints.
//!
//! A checkpoint is a directory `ROOT/step-{step:08}` holding:
//!
//! - one safetensors file per rank, `rank-{rank:05}.safetensors`. Each tensor in it is a
//!   [`TensorSlice`]: a box of a global tensor. The box (global shape and per-dimension offset)
//!   is stored as JSON in the safetensors `__metadata__` map under the tensor's name, so a file
//!   is self-describing and any safetensors reader can still open it. Because every slice knows
//!   where it belongs, a loader can reassemble or re-shard for a different layout;
//! - `manifest.json` ([`Manifest`]): format tag, step, world size, the sha256 and byte count of
//!   every file with the tensor names it holds, and the non-tensor `state` (config, RNG, data
//!   cursor, optimizer scalars, ...) as an opaque JSON value;
//! - an empty `COMMIT` marker, written last.
//!
//! **Readers ignore any directory without `COMMIT`** (and every `.tmp-*` directory). Writers build
//! the checkpoint in a staging directory, fsync everything, rename it into place and only then
//! create and fsync `COMMIT`; see [`commit`] for why a crash at any point leaves either a complete
//! checkpoint or one that readers skip. Readers check each file's byte count and sha256 against
//! the manifest before parsing it.
//!
//! Writing is split so that multi-rank writers can reuse the pieces: [`create_staging`] makes the
//! staging directory, [`write_shard`] writes one rank's file and returns its [`FileEntry`], and
//! [`commit`] writes the manifest and publishes the directory. [`write_checkpoint`] strings them
//! together for a single writer.

use std::collections::HashMap;
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use safetensors::tensor::TensorView;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The `format` tag written into (and required of) every manifest.
pub const FORMAT: &str = "wildfire-checkpoint/1";
/// File name of the manifest inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// File name of the commit marker; a checkpoint directory without it does not exist for readers.
pub const COMMIT_FILE: &str = "COMMIT";

/// Errors from writing, reading or pruning checkpoints. Each variant names the path or tensor
/// involved so the message alone says what to look at.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A filesystem operation failed.
    #[error("checkpoint I/O error on {}: {source}", path.display())]
    Io {
        /// The file or directory being accessed.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// A file's contents do not match what the manifest recorded.
    #[error("checkpoint file {} is corrupt: expected {expected}, found {actual}", path.display())]
    Corrupt {
        /// The damaged file.
        path: PathBuf,
        /// What the manifest recorded (sha256 and byte count).
        expected: String,
        /// What the file on disk has.
        actual: String,
    },
    /// The directory has no `COMMIT` marker, so it is an unfinished or abandoned write.
    #[error("checkpoint directory {} is not committed (no {COMMIT_FILE} marker)", dir.display())]
    NotCommitted {
        /// The directory without the marker.
        dir: PathBuf,
    },
    /// A manifest or shard file is readable but not what this format requires.
    #[error("checkpoint format error in {}: {reason}", path.display())]
    Format {
        /// The offending file or directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A committed checkpoint for this step already exists; it is never overwritten.
    #[error("checkpoint {} already exists and is committed", dir.display())]
    Exists {
        /// The existing checkpoint directory.
        dir: PathBuf,
    },
    /// A tensor slice is inconsistent (shape, offset, byte count or name).
    #[error("invalid tensor slice `{name}`: {reason}")]
    InvalidSlice {
        /// The tensor's name.
        name: String,
        /// What is inconsistent.
        reason: String,
    },
    /// One rank's part of a checkpoint written by many failed.
    #[error("checkpoint write failed on {who}: {reason}")]
    Rank {
        /// The rank (`rank 3`).
        who: String,
        /// What failed there.
        reason: String,
    },
    /// The ranks of a checkpoint written by many could not exchange their outcomes.
    #[error("checkpoint ranks could not communicate: {0}")]
    Comm(#[from] wildfire_backend::comm::CommError),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn format_err(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Format {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Tensor `name`'s slices, or its place in a module, are inconsistent: `reason` says how.
pub(crate) fn invalid_slice(name: &str, reason: String) -> CheckpointError {
    CheckpointError::InvalidSlice {
        name: name.to_string(),
        reason,
    }
}

/// Element types a checkpoint can hold (a subset of safetensors' dtypes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 64-bit signed integer.
    I64,
    /// 32-bit signed integer.
    I32,
    /// 32-bit unsigned integer.
    U32,
    /// 8-bit unsigned integer (also used for raw bytes).
    U8,
}

impl Dtype {
    /// Every supported dtype.
    pub const ALL: [Dtype; 8] = [
        Dtype::F32,
        Dtype::F64,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I64,
        Dtype::I32,
        Dtype::U32,
        Dtype::U8,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        self.to_safetensors().bitsize() / 8
    }

    /// The matching safetensors dtype.
    pub fn to_safetensors(self) -> safetensors::Dtype {
        use safetensors::Dtype as S;
        match self {
            Dtype::F32 => S::F32,
            Dtype::F64 => S::F64,
            Dtype::F16 => S::F16,
            Dtype::BF16 => S::BF16,
            Dtype::I64 => S::I64,
            Dtype::I32 => S::I32,
            Dtype::U32 => S::U32,
            Dtype::U8 => S::U8,
        }
    }

    /// The checkpoint dtype for a safetensors dtype, or `None` if this format does not use it.
    pub fn from_safetensors(dtype: safetensors::Dtype) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.to_safetensors() == dtype)
    }
}

/// The part of a global tensor that one file holds: the box starting at `offset` with extent
/// `shape` inside a tensor of `global_shape`, as little-endian row-major `bytes`.
///
/// An unsharded tensor has `offset` all zeros and `shape == global_shape` (see [`Self::whole`]).
#[derive(Clone, PartialEq)]
pub struct TensorSlice {
    /// Name of the global tensor (the same on every rank that holds a piece of it).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape of the full, unsharded tensor.
    pub global_shape: Vec<usize>,
    /// Start of this slice in each dimension of the global tensor.
    pub offset: Vec<usize>,
    /// Extent of this slice in each dimension.
    pub shape: Vec<usize>,
    /// The slice's elements, row-major, little-endian.
    pub bytes: Vec<u8>,
}

impl fmt::Debug for TensorSlice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Tensor payloads can be gigabytes; print their length, not their contents.
        f.debug_struct("TensorSlice")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("global_shape", &self.global_shape)
            .field("offset", &self.offset)
            .field("shape", &self.shape)
            .field("bytes", &format_args!("<{} bytes>", self.bytes.len()))
            .finish()
    }
}

impl TensorSlice {
    /// A slice covering a whole (unsharded) tensor.
    pub fn whole(name: impl Into<String>, dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>) -> Self {
        Self {
            name: name.into(),
            dtype,
            offset: vec![0; shape.len()],
            global_shape: shape.clone(),
            shape,
            bytes,
        }
    }

    /// Checks that ranks agree, the box lies inside the global tensor and the byte count is
    /// `product(shape) * dtype.size()`.
    pub fn validate(&self) -> Result<(), CheckpointError> {
        let bad = |reason: String| invalid_slice(&self.name, reason);
        if self.name.is_empty() || self.name == "__metadata__" {
            return Err(bad("reserved or empty tensor name".into()));
        }
        let rank = self.global_shape.len();
        if self.offset.len() != rank || self.shape.len() != rank {
            return Err(bad(format!(
                "rank mismatch: global_shape has {rank} dims, offset {}, shape {}",
                self.offset.len(),
                self.shape.len()
            )));
        }
        for (dim, ((&off, &len), &global)) in self
            .offset
            .iter()
            .zip(&self.shape)
            .zip(&self.global_shape)
            .enumerate()
        {
            if off.checked_add(len).is_none_or(|end| end > global) {
                return Err(bad(format!(
                    "dim {dim}: offset {off} + extent {len} exceeds global size {global}"
                )));
            }
        }
        let expected = self
            .shape
            .iter()
            .try_fold(self.dtype.size(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!("byte count of shape {:?} overflows", self.shape)))?;
        if self.bytes.len() != expected {
            return Err(bad(format!(
                "holds {} bytes but shape {:?} of {:?} needs {expected}",
                self.bytes.len(),
                self.shape,
                self.dtype
            )));
        }
        Ok(())
    }
}

/// Where a slice sits in its global tensor; stored per tensor in the safetensors metadata.
#[derive(Deserialize)]
struct SliceInfo {
    global_shape: Vec<usize>,
    offset: Vec<usize>,
}

/// One shard file as recorded in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name relative to the checkpoint directory, e.g. `rank-00000.safetensors`.
    pub path: String,
    /// Lowercase hex sha256 of the whole file.
    pub sha256: String,
    /// File length in bytes.
    pub bytes: u64,
    /// Names of the tensors in the file, in the order they were given to [`write_shard`].
    pub tensors: Vec<String>,
}

/// Contents of `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Training step this checkpoint was taken at.
    pub step: u64,
    /// Number of ranks (and shard files) that wrote it.
    pub world_size: usize,
    /// One entry per rank, in rank order.
    pub files: Vec<FileEntry>,
    /// Non-tensor state (config, RNG, data cursor, optimizer scalars, ...), opaque here.
    pub state: serde_json::Value,
}

/// `step-{step:08}`: the directory name of the checkpoint for `step`.
pub fn checkpoint_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// `rank-{rank:05}.safetensors`: the shard file name for `rank`.
pub fn shard_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

fn parse_step(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Lowercase hex of `bytes` (how checkpoint and data manifests write SHA-256s).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Flushes a directory's entries (new names, renames) to stable storage.
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    #[cfg(unix)]
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Creates (or truncates) `path`, writes `bytes` and fsyncs the file.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut file = File::create(path).map_err(io_err(path))?;
    file.write_all(bytes).map_err(io_err(path))?;
    file.sync_all().map_err(io_err(path))
}

/// Creates an empty staging directory `ROOT/.tmp-step-{step:08}-{pid}` (and `root` if needed),
/// replacing a leftover one from this process. Readers never look inside `.tmp-*` directories.
pub fn create_staging(root: &Path, step: u64) -> Result<PathBuf, CheckpointError> {
    fs::create_dir_all(root).map_err(io_err(root))?;
    let staging = root.join(format!(
        ".tmp-{}-{}",
        checkpoint_dir_name(step),
        std::process::id()
    ));
    if staging.exists() {
        fs::remove_dir_all(&staging).map_err(io_err(&staging))?;
    }
    fs::create_dir(&staging).map_err(io_err(&staging))?;
    Ok(staging)
}

/// Writes rank `rank`'s slices to `staging/rank-{rank:05}.safetensors`, fsyncs it and returns
/// the manifest entry to pass to [`commit`].
///
/// The slices are validated first. Their global shape and offset go into the safetensors
/// metadata under each tensor's key in the file: its name, or, for the second and later boxes of
/// one tensor in the file (the sections of a tensor-parallel fused projection), `name#1`,
/// `name#2`, … (see [`file_key`]). The file is built in memory, so peak memory is about twice the
/// shard's size.
pub fn write_shard(
    staging: &Path,
    rank: usize,
    slices: &[TensorSlice],
) -> Result<FileEntry, CheckpointError> {
    // The slices written so far, by tensor name.
    let mut boxes: HashMap<&str, Vec<&TensorSlice>> = HashMap::new();
    let mut metadata = HashMap::new();
    let mut views = Vec::with_capacity(slices.len());
    let mut keys = Vec::with_capacity(slices.len());
    for slice in slices {
        slice.validate()?;
        let earlier = boxes.entry(slice.name.as_str()).or_default();
        if earlier
            .iter()
            .any(|e| e.offset == slice.offset && e.shape == slice.shape)
        {
            return Err(CheckpointError::InvalidSlice {
                name: slice.name.clone(),
                reason: format!(
                    "the box {:?} at {:?} appears twice in rank {rank}'s shard",
                    slice.shape, slice.offset
                ),
            });
        }
        let key = file_key(&slice.name, earlier.len());
        earlier.push(slice);
        let info =
            serde_json::json!({ "global_shape": slice.global_shape, "offset": slice.offset });
        metadata.insert(key.clone(), info.to_string());
        keys.push(key);
        let view = TensorView::new(
            slice.dtype.to_safetensors(),
            slice.shape.clone(),
            &slice.bytes,
        )
        .map_err(|e| CheckpointError::InvalidSlice {
            name: slice.name.clone(),
            reason: e.to_string(),
        })?;
        views.push(view);
    }
    let views = keys.iter().map(String::as_str).zip(views);
    let name = shard_file_name(rank);
    let path = staging.join(&name);
    let data = safetensors::serialize(views, Some(metadata))
        .map_err(|e| format_err(&path, format!("safetensors serialization failed: {e}")))?;
    write_synced(&path, &data)?;
    Ok(FileEntry {
        path: name,
        sha256: sha256_hex(&data),
        bytes: data.len() as u64,
        tensors: keys,
    })
}

/// The key under which a file holds box number `index` (0-based, in writing order) of tensor
/// `name`: the name itself for the first, `name#index` after.
pub fn file_key(name: &str, index: usize) -> String {
    match index {
        0 => name.to_string(),
        _ => format!("{name}#{index}"),
    }
}

/// The tensor name of a file key (see [`file_key`]).
fn name_of_key(key: &str) -> &str {
    match key.rsplit_once('#') {
        Some((name, index)) if index.parse::<usize>().is_ok() => name,
        _ => key,
    }
}

/// The start (in elements) of every contiguous run of the box `offset`/`shape` in a row-major
/// tensor of shape `full`, in row-major order; each run is the box's last extent long.
fn box_runs(full: &[usize], offset: &[usize], shape: &[usize]) -> Vec<usize> {
    let Some((&run, outer)) = shape.split_last() else {
        return vec![0];
    };
    if run == 0 || outer.contains(&0) {
        return Vec::new();
    }
    let mut strides = vec![1; full.len()];
    for d in (0..full.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * full[d + 1];
    }
    let mut index = vec![0; outer.len()];
    let mut runs = Vec::new();
    loop {
        let start = (0..shape.len())
            .map(|d| (offset[d] + index.get(d).copied().unwrap_or(0)) * strides[d])
            .sum();
        runs.push(start);
        // Odometer over the outer dimensions, last fastest.
        let Some(d) = (0..outer.len()).rev().find(|&d| index[d] + 1 < outer[d]) else {
            return runs;
        };
        index[d] += 1;
        index[d + 1..].iter_mut().for_each(|i| *i = 0);
    }
}

/// The bytes of the box `offset`/`shape` of the row-major tensor `bytes` of shape `full`
/// (`elem` bytes per element).
pub fn cut_box(
    bytes: &[u8],
    elem: usize,
    full: &[usize],
    offset: &[usize],
    shape: &[usize],
) -> Vec<u8> {
    let run = shape.last().copied().unwrap_or(1) * elem;
    box_runs(full, offset, shape)
        .into_iter()
        .flat_map(|start| &bytes[start * elem..start * elem + run])
        .copied()
        .collect()
}

/// Writes `part`, the bytes of the box `offset`/`shape`, into the row-major tensor `bytes` of
/// shape `full` (`elem` bytes per element).
pub fn paste_box(
    bytes: &mut [u8],
    elem: usize,
    full: &[usize],
    offset: &[usize],
    shape: &[usize],
    part: &[u8],
) {
    let run = shape.last().copied().unwrap_or(1) * elem;
    for (start, source) in box_runs(full, offset, shape)
        .into_iter()
        .zip(part.chunks(run.max(1)))
    {
        bytes[start * elem..start * elem + run].copy_from_slice(source);
    }
}

/// Publishes a staging directory as `ROOT/step-{step:08}` and returns that path.
///
/// `files` must hold exactly one entry per rank `0..world_size` (any order; the manifest lists
/// them in rank order), each already written and fsynced into `staging` by [`write_shard`].
///
/// Order of operations, and why a crash anywhere is safe:
/// 1. write and fsync `manifest.json`, then fsync `staging` — all contents are durable while the
///    directory still has a `.tmp-*` name that readers ignore;
/// 2. if `step-{step:08}` exists with `COMMIT`, fail with [`CheckpointError::Exists`]; if it
///    exists without `COMMIT` it is an abandoned partial write: move it aside and delete it;
/// 3. rename `staging` to `step-{step:08}` — atomic; until `COMMIT` exists readers skip it, and
///    the next writer of this step clears it (step 2);
/// 4. create `COMMIT`, fsync it, fsync the checkpoint directory and then `root`. Only now is the
///    checkpoint visible, and every byte it refers to was made durable before the marker.
///    If the rename were lost in a crash, the marker would sit in a `.tmp-*` directory and still
///    be ignored.
pub fn commit(
    root: &Path,
    staging: &Path,
    step: u64,
    world_size: usize,
    files: Vec<FileEntry>,
    state: serde_json::Value,
) -> Result<PathBuf, CheckpointError> {
    if files.len() != world_size {
        return Err(format_err(
            staging,
            format!("{} shard files for world size {world_size}", files.len()),
        ));
    }
    let mut by_name: HashMap<String, FileEntry> =
        files.into_iter().map(|f| (f.path.clone(), f)).collect();
    let mut ordered = Vec::with_capacity(world_size);
    for rank in 0..world_size {
        let entry = by_name
            .remove(&shard_file_name(rank))
            .ok_or_else(|| format_err(staging, format!("no shard file for rank {rank}")))?;
        let path = staging.join(&entry.path);
        let len = fs::metadata(&path).map_err(io_err(&path))?.len();
        if len != entry.bytes {
            return Err(CheckpointError::Corrupt {
                path,
                expected: format!("{} bytes", entry.bytes),
                actual: format!("{len} bytes"),
            });
        }
        ordered.push(entry);
    }
    let manifest = Manifest {
        format: FORMAT.to_string(),
        step,
        world_size,
        files: ordered,
        state,
    };
    let manifest_path = staging.join(MANIFEST_FILE);
    let json = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| format_err(&manifest_path, e.to_string()))?;
    write_synced(&manifest_path, &json)?;
    sync_dir(staging)?;

    let dir = root.join(checkpoint_dir_name(step));
    if dir.join(COMMIT_FILE).exists() {
        return Err(CheckpointError::Exists { dir });
    }
    if dir.exists() {
        let aside = root.join(format!(
            ".tmp-abandoned-{}-{}",
            checkpoint_dir_name(step),
            std::process::id()
        ));
        fs::rename(&dir, &aside).map_err(io_err(&dir))?;
        fs::remove_dir_all(&aside).map_err(io_err(&aside))?;
    }
    fs::rename(staging, &dir).map_err(io_err(staging))?;
    write_synced(&dir.join(COMMIT_FILE), &[])?;
    sync_dir(&dir)?;
    sync_dir(root)?;
    Ok(dir)
}

/// Writes a complete checkpoint from one process: `shards` holds each rank's slices (ranks must
/// be exactly `0..shards.len()`, in any order), `state` goes into the manifest verbatim.
///
/// Returns the committed directory. Fails with [`CheckpointError::Exists`] before writing
/// anything if `step` is already committed; on failure the staging directory is removed.
pub fn write_checkpoint(
    root: &Path,
    step: u64,
    shards: &[(usize, Vec<TensorSlice>)],
    state: serde_json::Value,
) -> Result<PathBuf, CheckpointError> {
    let dir = root.join(checkpoint_dir_name(step));
    if dir.join(COMMIT_FILE).exists() {
        return Err(CheckpointError::Exists { dir });
    }
    let staging = create_staging(root, step)?;
    let result = shards
        .iter()
        .map(|(rank, slices)| write_shard(&staging, *rank, slices))
        .collect::<Result<Vec<_>, _>>()
        .and_then(|files| commit(root, &staging, step, shards.len(), files, state));
    if result.is_err() {
        // Best effort: a leftover `.tmp-*` directory is harmless, just wasted space.
        let _ = fs::remove_dir_all(&staging);
    }
    result
}

/// All committed checkpoints under `root` as `(step, dir)`, oldest first. A missing `root` has
/// none. Directories without `COMMIT`, `.tmp-*` directories and other names are skipped.
pub fn list_checkpoints(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let mut found = Vec::new();
    for entry in entries(root)? {
        let Some(step) = entry.file_name().to_str().and_then(parse_step) else {
            continue;
        };
        let dir = entry.path();
        if dir.is_dir() && dir.join(COMMIT_FILE).is_file() {
            found.push((step, dir));
        }
    }
    found.sort();
    Ok(found)
}

/// The entries of directory `root`; none when it does not exist.
fn entries(root: &Path) -> Result<Vec<fs::DirEntry>, CheckpointError> {
    match fs::read_dir(root) {
        Ok(entries) => entries.collect::<Result<_, _>>().map_err(io_err(root)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(io_err(root)(e)),
    }
}

/// Removes what interrupted writes left under `root`: staging directories (`.tmp-*`) and
/// checkpoint directories without `COMMIT`; returns them. A committed checkpoint is never
/// touched. Call it only while no writer is at work (a run's start).
pub fn remove_stale(root: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let mut removed = Vec::new();
    for entry in entries(root)? {
        let name = entry.file_name();
        let name = name.to_str().unwrap_or_default();
        let dir = entry.path();
        let staging = name.starts_with(".tmp-");
        let uncommitted = parse_step(name).is_some() && !dir.join(COMMIT_FILE).is_file();
        if dir.is_dir() && (staging || uncommitted) {
            fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
            removed.push(dir);
        }
    }
    removed.sort();
    Ok(removed)
}

/// The committed checkpoint with the highest step under `root`, if any.
pub fn latest_checkpoint(root: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    Ok(list_checkpoints(root)?.pop().map(|(_, dir)| dir))
}

/// Reads and checks the manifest of a committed checkpoint directory (format tag, one file per
/// rank, step matching the directory name). Shard files are not touched.
pub fn read_manifest(dir: &Path) -> Result<Manifest, CheckpointError> {
    if !dir.join(COMMIT_FILE).is_file() {
        return Err(CheckpointError::NotCommitted {
            dir: dir.to_path_buf(),
        });
    }
    let path = dir.join(MANIFEST_FILE);
    let text = fs::read(&path).map_err(io_err(&path))?;
    let manifest: Manifest =
        serde_json::from_slice(&text).map_err(|e| format_err(&path, e.to_string()))?;
    if manifest.format != FORMAT {
        return Err(format_err(
            &path,
            format!("format is {:?}, expected {FORMAT:?}", manifest.format),
        ));
    }
    if manifest.files.len() != manifest.world_size {
        return Err(format_err(
            &path,
            format!(
                "{} files listed for world size {}",
                manifest.files.len(),
                manifest.world_size
            ),
        ));
    }
    let dir_step = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_step);
    if dir_step.is_some_and(|s| s != manifest.step) {
        return Err(format_err(
            &path,
            format!(
                "manifest step {} does not match the directory name",
                manifest.step
            ),
        ));
    }
    for file in &manifest.files {
        // Entries are plain file names; anything else could point outside the checkpoint.
        if Path::new(&file.path).file_name() != Some(file.path.as_ref()) {
            return Err(format_err(&path, format!("bad file name {:?}", file.path)));
        }
    }
    Ok(manifest)
}

/// Reads a committed checkpoint: the manifest and every slice of every file, files in manifest
/// (rank) order and tensors in the order they were written.
///
/// Each file's byte count and sha256 are checked against the manifest before it is parsed, so
/// truncation or bit rot is reported as [`CheckpointError::Corrupt`] naming the file.
pub fn read_checkpoint(dir: &Path) -> Result<(Manifest, Vec<TensorSlice>), CheckpointError> {
    let manifest = read_manifest(dir)?;
    let mut slices = Vec::new();
    for entry in &manifest.files {
        let path = dir.join(&entry.path);
        let data = fs::read(&path).map_err(io_err(&path))?;
        let actual = sha256_hex(&data);
        if actual != entry.sha256 || data.len() as u64 != entry.bytes {
            return Err(CheckpointError::Corrupt {
                path,
                expected: format!("sha256 {} ({} bytes)", entry.sha256, entry.bytes),
                actual: format!("sha256 {actual} ({} bytes)", data.len()),
            });
        }
        slices.extend(parse_shard(&path, &data, &entry.tensors)?);
    }
    Ok((manifest, slices))
}

/// Parses one verified shard file into slices, in the order of `names`.
fn parse_shard(
    path: &Path,
    data: &[u8],
    names: &[String],
) -> Result<Vec<TensorSlice>, CheckpointError> {
    // A rank that holds nothing to save (a data-parallel replica) writes an empty shard, whose
    // header safetensors does not read back; its size and hash are already verified.
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let (_, header) =
        SafeTensors::read_metadata(data).map_err(|e| format_err(path, e.to_string()))?;
    let file = SafeTensors::deserialize(data).map_err(|e| format_err(path, e.to_string()))?;
    if file.len() != names.len() {
        return Err(format_err(
            path,
            format!(
                "holds {} tensors, manifest lists {}",
                file.len(),
                names.len()
            ),
        ));
    }
    let info = header.metadata().as_ref();
    names
        .iter()
        .map(|name| {
            let view = file
                .tensor(name)
                .map_err(|e| format_err(path, format!("tensor `{name}`: {e}")))?;
            let dtype = Dtype::from_safetensors(view.dtype()).ok_or_else(|| {
                format_err(
                    path,
                    format!("tensor `{name}` has unsupported dtype {}", view.dtype()),
                )
            })?;
            let text = info.and_then(|m| m.get(name)).ok_or_else(|| {
                format_err(path, format!("tensor `{name}` has no slice metadata"))
            })?;
            let placement: SliceInfo = serde_json::from_str(text)
                .map_err(|e| format_err(path, format!("tensor `{name}` slice metadata: {e}")))?;
            let slice = TensorSlice {
                name: name_of_key(name).to_string(),
                dtype,
                global_shape: placement.global_shape,
                offset: placement.offset,
                shape: view.shape().to_vec(),
                bytes: view.data().to_vec(),
            };
            slice
                .validate()
                .map_err(|e| format_err(path, e.to_string()))?;
            Ok(slice)
        })
        .collect()
}

/// Deletes committed checkpoints under `root` except the newest `keep_last` (`0` deletes all)
/// and returns the removed directories. `COMMIT` is removed first (and the directory fsynced),
/// so a crash mid-deletion leaves an uncommitted directory that readers ignore. Uncommitted
/// and `.tmp-*` directories are left alone: another writer may still own them.
pub fn prune(root: &Path, keep_last: usize) -> Result<Vec<PathBuf>, CheckpointError> {
    let mut all = list_checkpoints(root)?;
    let remove = all.len().saturating_sub(keep_last);
    let mut removed = Vec::with_capacity(remove);
    for (_, dir) in all.drain(..remove) {
        let marker = dir.join(COMMIT_FILE);
        fs::remove_file(&marker).map_err(io_err(&marker))?;
        sync_dir(&dir)?;
        fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        removed.push(dir);
    }
    if !removed.is_empty() {
        sync_dir(root)?;
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Cutting boxes out of a 3-D tensor and pasting them back rebuilds it, and the file key of
    /// a tensor's second box reads back as its name.
    #[test]
    fn boxes_cut_and_paste_row_major() {
        let full = [2, 3, 4];
        let bytes: Vec<u8> = (0..24).collect();
        let middle = cut_box(&bytes, 1, &full, &[0, 1, 1], &[2, 2, 2]);
        assert_eq!(middle, [5, 6, 9, 10, 17, 18, 21, 22]);
        let mut rebuilt = vec![0; 24];
        for (offset, shape) in [([0, 0, 0], [2, 3, 1]), ([0, 0, 1], [2, 3, 3])] {
            let part = cut_box(&bytes, 1, &full, &offset, &shape);
            paste_box(&mut rebuilt, 1, &full, &offset, &shape, &part);
        }
        assert_eq!(rebuilt, bytes);
        assert_eq!(cut_box(&bytes, 4, &[6], &[1], &[2]), bytes[4..12]);
        assert_eq!(name_of_key(&file_key("a.weight", 2)), "a.weight");
        assert_eq!(name_of_key("a#b"), "a#b");
    }

    /// A fresh, empty directory under the system temp dir; removed when dropped.
    struct TempRoot(PathBuf);

    impl TempRoot {
        fn new(tag: &str) -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!(
                "wildfire-ckpt-test-{}-{n}-{tag}",
                std::process::id()
            ));
            let _ = fs::remove_dir_all(&path);
            fs::create_dir_all(&path).expect("create temp root");
            Self(path)
        }
    }

    impl Drop for TempRoot {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    fn small(name: &str) -> TensorSlice {
        TensorSlice::whole(name, Dtype::F32, vec![2, 3], pattern(24, 1))
    }

    fn state() -> serde_json::Value {
        serde_json::json!({ "config": "lr = 0.1", "rng": [1, 2, 3], "cursor": 42 })
    }

    #[test]
    fn round_trip_all_dtypes_and_sharded_slices() {
        let root = TempRoot::new("roundtrip");
        let rank0: Vec<TensorSlice> = Dtype::ALL
            .iter()
            .enumerate()
            .map(|(i, &dt)| {
                let shape = vec![3, i + 1];
                TensorSlice::whole(
                    format!("w{i}"),
                    dt,
                    shape,
                    pattern(3 * (i + 1) * dt.size(), i as u8),
                )
            })
            .chain([TensorSlice::whole(
                "scalar",
                Dtype::I64,
                vec![],
                pattern(8, 9),
            )])
            .collect();
        // Rows 2..4 of a 4x5 matrix: the second half of a row-sharded tensor.
        let half = |offset: usize, seed| TensorSlice {
            name: "emb".into(),
            dtype: Dtype::BF16,
            global_shape: vec![4, 5],
            offset: vec![offset, 0],
            shape: vec![2, 5],
            bytes: pattern(2 * 5 * 2, seed),
        };
        let rank1 = vec![half(2, 7)];
        let mut rank0 = rank0;
        rank0.push(half(0, 3));
        let shards = vec![(1, rank1.clone()), (0, rank0.clone())];

        let dir = write_checkpoint(&root.0, 12, &shards, state()).expect("write");
        assert_eq!(dir, root.0.join("step-00000012"));
        assert!(dir.join(COMMIT_FILE).is_file());

        let (manifest, slices) = read_checkpoint(&dir).expect("read");
        assert_eq!(manifest.format, FORMAT);
        assert_eq!(manifest.step, 12);
        assert_eq!(manifest.world_size, 2);
        assert_eq!(manifest.state, state());
        assert_eq!(manifest.files[0].path, "rank-00000.safetensors");
        assert_eq!(manifest.files[1].path, "rank-00001.safetensors");
        let expected: Vec<TensorSlice> = rank0.into_iter().chain(rank1).collect();
        assert_eq!(slices, expected); // bitwise: bytes compared exactly
        let names: Vec<&str> = manifest.files[0]
            .tensors
            .iter()
            .map(String::as_str)
            .collect();
        assert_eq!(names[..2], ["w0", "w1"]);
    }

    #[test]
    fn shard_file_is_plain_safetensors_with_slice_metadata() {
        let root = TempRoot::new("plain");
        let slice = TensorSlice {
            name: "layer.weight".into(),
            dtype: Dtype::F32,
            global_shape: vec![8, 4],
            offset: vec![4, 0],
            shape: vec![4, 4],
            bytes: pattern(64, 5),
        };
        let dir = write_checkpoint(&root.0, 1, &[(0, vec![slice.clone()])], state()).unwrap();
        let data = fs::read(dir.join("rank-00000.safetensors")).unwrap();
        let file = SafeTensors::deserialize(&data).expect("plain safetensors reader");
        let view = file.tensor("layer.weight").unwrap();
        assert_eq!(view.dtype(), safetensors::Dtype::F32);
        assert_eq!(view.shape(), [4, 4]);
        assert_eq!(view.data(), slice.bytes.as_slice());
        let (_, header) = SafeTensors::read_metadata(&data).unwrap();
        let meta = header.metadata().as_ref().unwrap();
        let info: serde_json::Value = serde_json::from_str(&meta["layer.weight"]).unwrap();
        assert_eq!(
            info,
            serde_json::json!({ "global_shape": [8, 4], "offset": [4, 0] })
        );
    }

    #[test]
    fn latest_ignores_uncommitted_and_tmp_dirs() {
        let root = TempRoot::new("latest");
        assert_eq!(latest_checkpoint(&root.0).unwrap(), None);
        assert_eq!(latest_checkpoint(&root.0.join("missing")).unwrap(), None);
        for step in [3, 10, 7] {
            write_checkpoint(&root.0, step, &[(0, vec![small("a")])], state()).unwrap();
        }
        // Higher steps that are not committed: a partial rename target and a staging dir.
        fs::create_dir(root.0.join("step-00000020")).unwrap();
        fs::create_dir(root.0.join(".tmp-step-00000030-1")).unwrap();
        fs::write(root.0.join(".tmp-step-00000030-1").join(COMMIT_FILE), b"").unwrap();
        fs::create_dir(root.0.join("notes")).unwrap();
        let latest = latest_checkpoint(&root.0).unwrap();
        assert_eq!(latest, Some(root.0.join("step-00000010")));
        let steps: Vec<u64> = list_checkpoints(&root.0)
            .unwrap()
            .iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(steps, [3, 7, 10]);
    }

    #[test]
    fn flipped_byte_is_reported_as_corrupt_with_path() {
        let root = TempRoot::new("corrupt");
        let dir = write_checkpoint(&root.0, 5, &[(0, vec![small("a")])], state()).unwrap();
        let file = dir.join("rank-00000.safetensors");
        let mut data = fs::read(&file).unwrap();
        let last = data.len() - 1;
        data[last] ^= 0x01;
        fs::write(&file, &data).unwrap();
        let err = read_checkpoint(&dir).unwrap_err();
        assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains(&file.display().to_string()), "{msg}");
        let manifest = read_manifest(&dir).unwrap();
        assert!(msg.contains(&manifest.files[0].sha256), "{msg}");
    }

    #[test]
    fn missing_file_and_missing_commit_are_refused() {
        let root = TempRoot::new("missing");
        let shards = [(0, vec![small("a")]), (1, vec![small("b")])];
        let dir = write_checkpoint(&root.0, 2, &shards, state()).unwrap();
        let file = dir.join("rank-00001.safetensors");
        fs::remove_file(&file).unwrap();
        let err = read_checkpoint(&dir).unwrap_err();
        assert!(matches!(err, CheckpointError::Io { .. }), "{err}");
        assert!(
            err.to_string().contains(&file.display().to_string()),
            "{err}"
        );

        fs::remove_file(dir.join(COMMIT_FILE)).unwrap();
        let err = read_checkpoint(&dir).unwrap_err();
        assert!(matches!(err, CheckpointError::NotCommitted { .. }), "{err}");
        assert!(
            err.to_string().contains(&dir.display().to_string()),
            "{err}"
        );
        assert_eq!(latest_checkpoint(&root.0).unwrap(), None);
    }

    #[test]
    fn invalid_slices_are_rejected_naming_the_tensor() {
        let root = TempRoot::new("invalid");
        let mut wrong_len = small("short.bias");
        wrong_len.bytes.pop();
        let err = write_checkpoint(&root.0, 1, &[(0, vec![wrong_len])], state()).unwrap_err();
        assert!(matches!(err, CheckpointError::InvalidSlice { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("short.bias") && msg.contains("23") && msg.contains("24"),
            "{msg}"
        );

        let mut outside = small("outside");
        outside.global_shape = vec![3, 3];
        outside.offset = vec![2, 0];
        let msg = outside.validate().unwrap_err().to_string();
        assert!(msg.contains("outside") && msg.contains("dim 0"), "{msg}");

        let mut ranks = small("ranks");
        ranks.offset = vec![0];
        assert!(
            ranks
                .validate()
                .unwrap_err()
                .to_string()
                .contains("rank mismatch")
        );

        let dup = vec![small("twice"), small("twice")];
        let err = write_checkpoint(&root.0, 1, &[(0, dup)], state()).unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");

        let err = write_checkpoint(&root.0, 1, &[(1, vec![small("a")])], state()).unwrap_err();
        assert!(err.to_string().contains("rank 0"), "{err}");
        // Failed writes leave nothing behind.
        assert_eq!(fs::read_dir(&root.0).unwrap().count(), 0);
    }

    #[test]
    fn same_step_twice_is_refused_but_partial_is_replaced() {
        let root = TempRoot::new("exists");
        let dir = write_checkpoint(&root.0, 4, &[(0, vec![small("a")])], state()).unwrap();
        let err = write_checkpoint(&root.0, 4, &[(0, vec![small("b")])], state()).unwrap_err();
        assert!(matches!(err, CheckpointError::Exists { .. }), "{err}");
        assert!(
            err.to_string().contains(&dir.display().to_string()),
            "{err}"
        );

        // A directory without COMMIT is an abandoned write and gets replaced.
        let partial = root.0.join("step-00000009");
        fs::create_dir(&partial).unwrap();
        fs::write(partial.join("junk"), b"x").unwrap();
        let dir = write_checkpoint(&root.0, 9, &[(0, vec![small("c")])], state()).unwrap();
        assert!(!dir.join("junk").exists());
        let (_, slices) = read_checkpoint(&dir).unwrap();
        assert_eq!(slices, [small("c")]);
        let leftovers = fs::read_dir(&root.0)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with('.')
            })
            .count();
        assert_eq!(leftovers, 0);
    }

    #[test]
    fn prune_keeps_newest() {
        let root = TempRoot::new("prune");
        for step in 1..=5 {
            write_checkpoint(&root.0, step, &[(0, vec![small("a")])], state()).unwrap();
        }
        fs::create_dir(root.0.join("step-00000000")).unwrap(); // uncommitted: left alone
        let removed = prune(&root.0, 2).unwrap();
        assert_eq!(removed.len(), 3);
        let steps: Vec<u64> = list_checkpoints(&root.0)
            .unwrap()
            .iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(steps, [4, 5]);
        assert!(!root.0.join("step-00000001").exists());
        assert!(root.0.join("step-00000000").exists());
        assert!(prune(&root.0, 10).unwrap().is_empty());
    }

    #[test]
    fn tampered_manifest_is_a_format_error() {
        let root = TempRoot::new("manifest");
        let dir = write_checkpoint(&root.0, 6, &[(0, vec![small("a")])], state()).unwrap();
        let path = dir.join(MANIFEST_FILE);
        let mut manifest = read_manifest(&dir).unwrap();
        manifest.files[0].path = "../escape.safetensors".into();
        fs::write(&path, serde_json::to_vec(&manifest).unwrap()).unwrap();
        let err = read_checkpoint(&dir).unwrap_err();
        assert!(matches!(err, CheckpointError::Format { .. }), "{err}");
        fs::write(&path, b"{ not json").unwrap();
        let err = read_manifest(&dir).unwrap_err();
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
    }
}
