//! Prepared data: token shards that `wildfire prepare` writes once and training reads through
//! memory maps, so a run's start-up time and memory do not grow with the corpus.
//!
//! A prepared directory holds `manifest.json` and shards `train-00000.bin`, `val-00000.bin`, …:
//! little-endian token ids (`u16` when the vocabulary fits, else `u32`), each split's documents
//! concatenated in input order, each followed by the tokenizer's end-of-text id. A split is one
//! token stream across its shards; the sampler cuts it into windows as it cuts an in-memory
//! corpus, and a rank touches only the pages of its own windows.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use memmap2::Mmap;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::tokenizer::TokenizerKind;
use crate::checkpoint::store::hex;

/// The manifest's file name inside a prepared directory.
pub const MANIFEST: &str = "manifest.json";
/// The manifest format this build writes and reads.
pub const FORMAT: u32 = 1;

/// How token ids are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    U16,
    U32,
}

impl TokenDtype {
    pub fn bytes(self) -> usize {
        match self {
            Self::U16 => 2,
            Self::U32 => 4,
        }
    }

    /// The largest vocabulary this dtype stores.
    pub fn max_vocab(self) -> usize {
        match self {
            Self::U16 => 1 << 16,
            Self::U32 => 1 << 32,
        }
    }

    /// The narrowest dtype for a vocabulary of `size`.
    pub fn for_vocab(size: usize) -> Self {
        match size <= Self::U16.max_vocab() {
            true => Self::U16,
            false => Self::U32,
        }
    }
}

/// Training or held-out validation data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    Train,
    Val,
}

impl std::fmt::Display for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Train => "train",
            Self::Val => "val",
        })
    }
}

/// One shard file of a split.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub split: Split,
    /// The file name, inside the prepared directory.
    pub file: String,
    pub tokens: u64,
    /// Hex SHA-256 of the file's bytes.
    pub sha256: String,
}

/// Documents per split.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DocumentCounts {
    pub train: u64,
    pub val: u64,
}

/// What a prepared directory holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub tokenizer: TokenizerKind,
    /// What rebuilds the tokenizer ([`super::Tokenizer::stored`]): the character vocabulary in
    /// id order, nothing for GPT-2 BPE, or a Hugging Face `tokenizer.json`'s text.
    pub vocab: String,
    pub vocab_size: usize,
    /// The id that follows every document.
    pub end_of_text: u32,
    pub dtype: TokenDtype,
    /// The validation split's seed and expected fraction of documents.
    pub seed: u64,
    pub val_fraction: f64,
    pub documents: DocumentCounts,
    /// Input documents left out for not being UTF-8 (`--skip-invalid`).
    pub skipped_documents: u64,
    pub shards: Vec<ShardEntry>,
}

impl Manifest {
    /// The tokens of `split` in all.
    pub fn tokens(&self, split: Split) -> u64 {
        (self.shards.iter())
            .filter(|s| s.split == split)
            .map(|s| s.tokens)
            .sum()
    }
}

/// Whether `path` is a prepared directory (it holds a manifest).
pub fn is_prepared(path: &Path) -> bool {
    path.join(MANIFEST).is_file()
}

/// An opened prepared directory: its manifest, the manifest's hash (what a checkpoint records)
/// and each split's tokens, memory-mapped.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub dir: PathBuf,
    pub manifest: Manifest,
    /// Hex SHA-256 of `manifest.json`'s bytes: it names every shard's hash, so it names the data.
    pub hash: String,
    pub train: Tokens,
    pub val: Tokens,
}

impl Prepared {
    /// Opens `dir`: reads its manifest, checks every shard's size and SHA-256 (all cores, before
    /// any training), and maps the shards.
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join(MANIFEST);
        let bytes =
            std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let manifest: Manifest = serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a wildfire data manifest", path.display()))?;
        if manifest.format != FORMAT {
            bail!(
                "{} is format {}, this build reads format {FORMAT}: prepare the data again",
                path.display(),
                manifest.format
            );
        }
        (manifest.shards.par_iter())
            .try_for_each(|shard| check_shard(dir, shard, manifest.dtype))?;
        let split = |split| Tokens::mapped(dir, &manifest, split);
        Ok(Self {
            dir: dir.to_path_buf(),
            train: split(Split::Train)?,
            val: split(Split::Val)?,
            hash: hex(&Sha256::digest(&bytes)),
            manifest,
        })
    }
}

/// A weighted blend of prepared directories (`data.path = "DIR:WEIGHT,DIR:WEIGHT,…"`, as
/// Megatron's `--data-path` blends): their training streams one after another, each drawn with
/// its weight by [`super::Sampler::blended`]; validation is their validation streams in turn.
#[derive(Debug, Clone)]
pub struct Blend {
    pub parts: Vec<Prepared>,
    pub weights: Vec<f64>,
    /// Where each part's training tokens start in `train`.
    pub bases: Vec<usize>,
    pub train: Tokens,
    pub val: Tokens,
    /// Hex SHA-256 over the parts' manifest hashes and weights: what a checkpoint records.
    pub hash: String,
}

impl Blend {
    /// The blend `spec` names, when it is one: `DIR:WEIGHT` pairs separated by commas (two at
    /// least, or one with a weight), every weight a number.
    pub fn parse(spec: &str) -> Option<Vec<(PathBuf, f64)>> {
        let parts: Option<Vec<(PathBuf, f64)>> = (spec.split(','))
            .map(|part| {
                let (dir, weight) = part.rsplit_once(':')?;
                Some((PathBuf::from(dir), weight.trim().parse().ok()?))
            })
            .collect();
        parts.filter(|p| !p.is_empty())
    }

    /// Opens every part (see [`Prepared::open`]); they must share tokenizer, vocabulary and
    /// dtype.
    pub fn open(spec: &[(PathBuf, f64)]) -> anyhow::Result<Self> {
        let parts: Vec<Prepared> = (spec.iter())
            .map(|(dir, _)| {
                Prepared::open(dir).with_context(|| format!("blend part {}", dir.display()))
            })
            .collect::<anyhow::Result<_>>()?;
        let first = &parts[0].manifest;
        for (part, (dir, _)) in parts.iter().zip(spec).skip(1) {
            let m = &part.manifest;
            if (m.tokenizer, &m.vocab, m.dtype) != (first.tokenizer, &first.vocab, first.dtype) {
                bail!(
                    "blend part {} was prepared with the {} tokenizer ({} ids, {:?}), but {} with \
                     the {} tokenizer ({} ids, {:?}): a blend's parts must share a tokenizer",
                    dir.display(),
                    m.tokenizer,
                    m.vocab_size,
                    m.dtype,
                    spec[0].0.display(),
                    first.tokenizer,
                    first.vocab_size,
                    first.dtype
                );
            }
        }
        let weights: Vec<f64> = spec.iter().map(|(_, w)| *w).collect();
        if let Some(bad) = weights.iter().find(|w| !(**w > 0.0 && w.is_finite())) {
            bail!("blend weights must be positive numbers, not {bad}");
        }
        let in_turn: Vec<(&Path, &Manifest)> = (parts.iter())
            .map(|p| (p.dir.as_path(), &p.manifest))
            .collect();
        let bases = (parts.iter())
            .scan(0, |next, p| {
                *next += p.train.len();
                Some(*next - p.train.len())
            })
            .collect();
        let mut hasher = Sha256::new();
        for (part, weight) in parts.iter().zip(&weights) {
            hasher.update(format!("{}:{weight};", part.hash));
        }
        Ok(Self {
            train: Tokens::mapped_in_turn(&in_turn, Split::Train)?,
            val: Tokens::mapped_in_turn(&in_turn, Split::Val)?,
            hash: hex(&hasher.finalize()),
            bases,
            weights,
            parts,
        })
    }
}

/// Checks that `shard` has the size its token count gives and the SHA-256 its entry records.
fn check_shard(dir: &Path, shard: &ShardEntry, dtype: TokenDtype) -> anyhow::Result<()> {
    let path = dir.join(&shard.file);
    let mut file =
        File::open(&path).with_context(|| format!("shard {} is missing", path.display()))?;
    let size = file.metadata()?.len();
    let expected = shard.tokens * dtype.bytes() as u64;
    if size != expected {
        bail!(
            "shard {} holds {size} bytes, but the manifest records {} {dtype:?} tokens ({expected} \
             bytes): it is truncated or was changed; prepare the data again",
            path.display(),
            shard.tokens
        );
    }
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let read = file.read(&mut buffer)?;
        if read == 0 {
            break;
        }
        hasher.update(&buffer[..read]);
    }
    let actual = hex(&hasher.finalize());
    if actual != shard.sha256 {
        bail!(
            "shard {} has SHA-256 {actual}, but the manifest records {}: the file is corrupted or \
             was changed; prepare the data again",
            path.display(),
            shard.sha256
        );
    }
    Ok(())
}

/// A stream of token ids read by windows: an in-memory corpus, or a split's mapped shards.
#[derive(Debug, Clone)]
pub enum Tokens {
    Memory(Arc<Vec<u32>>),
    Mapped(Arc<MappedTokens>),
}

/// A split's shards, mapped, as one stream.
#[derive(Debug)]
pub struct MappedTokens {
    /// Each shard's map and the stream position of its first token.
    shards: Vec<(Mmap, usize)>,
    dtype: TokenDtype,
    len: usize,
}

impl Tokens {
    /// The mapped shards of `split` of the prepared `dir`.
    fn mapped(dir: &Path, manifest: &Manifest, split: Split) -> anyhow::Result<Self> {
        Self::mapped_in_turn(&[(dir, manifest)], split)
    }

    /// The mapped shards of `split` of several prepared directories, one after another (they
    /// share a dtype).
    fn mapped_in_turn(dirs: &[(&Path, &Manifest)], split: Split) -> anyhow::Result<Self> {
        let mut shards = Vec::new();
        let mut len = 0;
        let entries = (dirs.iter()).flat_map(|(dir, manifest)| {
            (manifest.shards.iter().filter(|s| s.split == split)).map(move |shard| (dir, shard))
        });
        for (dir, shard) in entries {
            let path = dir.join(&shard.file);
            let file =
                File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
            // SAFETY: the map is read-only, and a prepared directory's shards are written once
            // (a new preparation writes a new directory); a file changed under the map would
            // change the tokens read, not memory safety of this process's other data.
            let map = unsafe { Mmap::map(&file) }
                .with_context(|| format!("cannot map {}", path.display()))?;
            shards.push((map, len));
            len += shard.tokens as usize;
        }
        Ok(Self::Mapped(Arc::new(MappedTokens {
            shards,
            dtype: dirs.first().map_or(TokenDtype::U16, |(_, m)| m.dtype),
            len,
        })))
    }

    pub fn len(&self) -> usize {
        match self {
            Self::Memory(tokens) => tokens.len(),
            Self::Mapped(mapped) => mapped.len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends tokens `start..start + count` to `out`.
    pub fn extend_from(&self, start: usize, count: usize, out: &mut Vec<u32>) {
        match self {
            Self::Memory(tokens) => out.extend_from_slice(&tokens[start..start + count]),
            Self::Mapped(mapped) => mapped.extend_from(start, count, out),
        }
    }
}

impl MappedTokens {
    fn extend_from(&self, start: usize, count: usize, out: &mut Vec<u32>) {
        assert!(
            start + count <= self.len,
            "tokens {start}..{} of a stream of {}",
            start + count,
            self.len
        );
        let width = self.dtype.bytes();
        let mut at = start;
        // The last shard that starts at or before `at`, then on through the following ones.
        let mut shard = self.shards.partition_point(|(_, first)| *first <= at) - 1;
        while at < start + count {
            let (map, first) = &self.shards[shard];
            let shard_tokens = map.len() / width;
            let end = (start + count).min(first + shard_tokens);
            let bytes = &map[(at - first) * width..(end - first) * width];
            match self.dtype {
                TokenDtype::U16 => out.extend(
                    (bytes.chunks_exact(2)).map(|b| u32::from(u16::from_le_bytes([b[0], b[1]]))),
                ),
                TokenDtype::U32 => out.extend(
                    (bytes.chunks_exact(4)).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                ),
            }
            at = end;
            shard += 1;
        }
    }
}
