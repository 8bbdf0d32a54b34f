//! `wildfire prepare`: text files, directories and JSON lines into the token shards of a
//! prepared directory (see [`super::prepared`]).
//!
//! - **Documents.** A text file is one document; a `.jsonl` file holds one document per line,
//!   the string in field `--text-field`; empty ones are left out. Inputs are read in the order
//!   given, a directory's files in path order. Each document is followed by the tokenizer's
//!   end-of-text id: GPT-2's `<|endoftext|>`; a Hugging Face tokenizer's first of
//!   [`END_OF_TEXT_NAMES`] (`<|end_of_text|>` for Llama 3); and for characters U+0003 (whose
//!   Unicode name is END OF TEXT), reserved: an input that holds it is refused.
//! - **Validation** takes whole documents: document `i` is held out when a uniform draw seeded
//!   by `(seed, i)` falls below `--val-fraction`, so the split depends on nothing but the seed
//!   and the documents' order.
//! - **Determinism.** Documents are encoded on all threads and written in input order. A long
//!   document is encoded in pieces cut after the first newline past every 1 MiB, positions
//!   that depend on the text alone. So the output is byte-identical whatever the number of
//!   threads, and decodes back to the input exactly (with a Hugging Face tokenizer, where its
//!   decoder inverts its encoder, as byte-level ones do).
//! - **Nothing half-written.** Everything goes to a sibling temporary directory, renamed to
//!   `--out` once complete; an existing `--out` is never touched.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rayon::prelude::*;
use sha2::{Digest, Sha256};

use super::corpus::collect_files;
use super::hf_tokenizer::END_OF_TEXT_NAMES;
use super::prepared::{DocumentCounts, FORMAT, MANIFEST, Manifest, ShardEntry, Split, TokenDtype};
use super::sampler::SplitMix64;
use super::tokenizer::{Tokenizer, TokenizerKind};
use crate::checkpoint::store::hex;

/// The character tokenizer's end-of-text character (Unicode's END OF TEXT control).
pub const CHAR_END_OF_TEXT: char = '\u{3}';
/// Encoding pieces of a long document are cut after the first newline past every this many
/// bytes.
const PIECE_BYTES: usize = 1 << 20;

/// What `wildfire prepare` does.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    pub inputs: Vec<PathBuf>,
    pub out: PathBuf,
    pub tokenizer: TokenizerKind,
    /// The `tokenizer.json` of `TokenizerKind::Hf`.
    pub tokenizer_file: Option<PathBuf>,
    pub val_fraction: f64,
    pub seed: u64,
    /// The field of a `.jsonl` line that holds the document's text.
    pub text_field: String,
    /// Skip documents that are not UTF-8 (counted in the manifest) instead of failing.
    pub skip_invalid: bool,
    /// The token dtype; the narrowest that fits when `None`.
    pub dtype: Option<TokenDtype>,
    /// Tokens per shard file at most.
    pub shard_tokens: u64,
    /// Print progress to stderr.
    pub progress: bool,
}

/// One input document: where it came from, and its text (`None`: not UTF-8, skipped).
struct Document {
    origin: String,
    text: Option<String>,
}

/// Runs `wildfire prepare`; returns the manifest written.
pub fn prepare(options: &PrepareOptions) -> anyhow::Result<Manifest> {
    check_options(options)?;
    let files = input_files(&options.inputs)?;
    let total_bytes: u64 = (files.iter())
        .map(|f| fs::metadata(f).map(|m| m.len()).unwrap_or(0))
        .sum();
    let tokenizer = match (options.tokenizer, &options.tokenizer_file) {
        (TokenizerKind::Gpt2, _) => Tokenizer::gpt2()?,
        (TokenizerKind::Char, _) => char_vocabulary(&files, options)?,
        (TokenizerKind::Hf, Some(path)) => Tokenizer::hugging_face(path)?,
        (TokenizerKind::Hf, None) => bail!("a Hugging Face tokenizer needs its tokenizer.json"),
    };
    let vocab_size = tokenizer.vocab_size();
    let end_of_text = match &tokenizer {
        Tokenizer::Gpt2(_) => super::gpt2::GPT2_END_OF_TEXT,
        Tokenizer::Char { chars } => chars
            .binary_search(&CHAR_END_OF_TEXT)
            .expect("reserved in the vocabulary") as u32,
        Tokenizer::Hf(hf) => hf.end_of_text().with_context(|| {
            format!(
                "the tokenizer has none of the end-of-text tokens {END_OF_TEXT_NAMES:?} to \
                 separate documents with"
            )
        })?,
    };
    let dtype = options.dtype.unwrap_or(TokenDtype::for_vocab(vocab_size));
    if vocab_size > dtype.max_vocab() {
        bail!(
            "the {} tokenizer's vocabulary of {vocab_size} does not fit {dtype:?} tokens (at \
             most {}): choose --dtype u32",
            options.tokenizer,
            dtype.max_vocab()
        );
    }
    let staging = staging_dir(&options.out)?;
    let written = write_shards(
        &files,
        &tokenizer,
        end_of_text,
        dtype,
        &staging,
        options,
        total_bytes,
    );
    let (shards, documents, skipped) = match written {
        Ok(written) => written,
        Err(error) => {
            let _ = fs::remove_dir_all(&staging);
            return Err(error);
        }
    };
    let manifest = Manifest {
        format: FORMAT,
        tokenizer: options.tokenizer,
        vocab: tokenizer.definition(),
        vocab_size,
        end_of_text,
        dtype,
        seed: options.seed,
        val_fraction: options.val_fraction,
        documents,
        skipped_documents: skipped,
        shards,
    };
    let finish = || -> anyhow::Result<()> {
        let json = serde_json::to_string_pretty(&manifest)?;
        fs::write(staging.join(MANIFEST), json)?;
        fs::rename(&staging, &options.out)
            .with_context(|| format!("cannot move the prepared data to {}", options.out.display()))
    };
    if let Err(error) = finish() {
        let _ = fs::remove_dir_all(&staging);
        return Err(error);
    }
    Ok(manifest)
}

fn check_options(options: &PrepareOptions) -> anyhow::Result<()> {
    if !(0.0..1.0).contains(&options.val_fraction) {
        bail!("--val-fraction {} is outside [0, 1)", options.val_fraction);
    }
    if options.shard_tokens == 0 {
        bail!("--shard-tokens must be at least 1");
    }
    if options.inputs.is_empty() {
        bail!("no --input given");
    }
    if options.out.exists() {
        bail!(
            "{} already exists: prepare into a new directory (nothing is overwritten)",
            options.out.display()
        );
    }
    Ok(())
}

/// The files of `inputs`, in order (a directory's files in path order).
fn input_files(inputs: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for input in inputs {
        let metadata = fs::metadata(input)
            .with_context(|| format!("input {} cannot be read", input.display()))?;
        if metadata.is_dir() {
            let mut found = Vec::new();
            collect_files(input, &mut found)?;
            found.sort();
            files.extend(found);
        } else {
            files.push(input.clone());
        }
    }
    Ok(files)
}

/// A new, empty directory beside `out` to write into.
fn staging_dir(out: &Path) -> anyhow::Result<PathBuf> {
    let name = out
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("prepared");
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let staging = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir(&staging).with_context(|| format!("cannot create {}", staging.display()))?;
    Ok(staging)
}

/// The documents of `file`.
fn read_documents(file: &Path, options: &PrepareOptions) -> anyhow::Result<Vec<Document>> {
    let bytes = fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let jsonl = file.extension().is_some_and(|e| e == "jsonl");
    if !jsonl {
        let text = utf8(bytes, &file.display().to_string(), 0, options.skip_invalid)?;
        if text.as_deref() == Some("") {
            return Ok(Vec::new());
        }
        return Ok(vec![Document {
            origin: file.display().to_string(),
            text,
        }]);
    }
    let mut documents = Vec::new();
    let mut offset = 0;
    for (number, line) in bytes.split(|&b| b == b'\n').enumerate() {
        let line_offset = offset;
        offset += line.len() + 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let origin = format!("{}:{}", file.display(), number + 1);
        let Some(line) = utf8(line.to_vec(), &origin, line_offset, options.skip_invalid)? else {
            documents.push(Document { origin, text: None });
            continue;
        };
        let value: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("{origin} is not a JSON line"))?;
        let Some(text) = value.get(&options.text_field).and_then(|v| v.as_str()) else {
            bail!(
                "{origin} has no string field {:?} (choose the field with --text-field)",
                options.text_field
            );
        };
        if !text.is_empty() {
            documents.push(Document {
                origin,
                text: Some(text.to_string()),
            });
        }
    }
    Ok(documents)
}

/// `bytes` as text; not UTF-8 is an error naming `origin` and the byte offset (from `base`),
/// or `None` when skipping.
fn utf8(bytes: Vec<u8>, origin: &str, base: usize, skip: bool) -> anyhow::Result<Option<String>> {
    match String::from_utf8(bytes) {
        Ok(text) => Ok(Some(text)),
        Err(_) if skip => Ok(None),
        Err(error) => bail!(
            "{origin} is not UTF-8 text: invalid byte at offset {} (pass --skip-invalid to skip \
             such documents)",
            base + error.utf8_error().valid_up_to()
        ),
    }
}

/// The character tokenizer over every character of the inputs, plus the end-of-text one.
fn char_vocabulary(files: &[PathBuf], options: &PrepareOptions) -> anyhow::Result<Tokenizer> {
    let mut chars = std::collections::BTreeSet::from([CHAR_END_OF_TEXT]);
    for file in files {
        for document in read_documents(file, options)? {
            let Some(text) = document.text else { continue };
            if let Some(at) = text.find(CHAR_END_OF_TEXT) {
                bail!(
                    "{} holds U+0003 at byte {at}, which the character tokenizer reserves for \
                     the end of a document",
                    document.origin
                );
            }
            chars.extend(text.chars());
        }
    }
    Ok(Tokenizer::from_chars(
        &chars.into_iter().collect::<String>(),
    ))
}

/// Whether document `index` is held out for validation.
fn is_validation(seed: u64, index: u64, val_fraction: f64) -> bool {
    let mut rng = SplitMix64::new(seed ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03));
    val_fraction > 0.0 && rng.unit() < val_fraction
}

/// `text` cut after the first newline past every [`PIECE_BYTES`] (the whole of it when there
/// is none).
fn pieces(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut rest = text;
    while rest.len() > PIECE_BYTES {
        match rest[PIECE_BYTES..].find('\n') {
            Some(at) => {
                let (piece, tail) = rest.split_at(PIECE_BYTES + at + 1);
                pieces.push(piece);
                rest = tail;
            }
            None => break,
        }
    }
    pieces.push(rest);
    pieces
}

/// The shard files of both splits, being written.
struct ShardWriters<'a> {
    dir: &'a Path,
    dtype: TokenDtype,
    max_tokens: u64,
    open: [Option<OpenShard>; 2],
    done: Vec<ShardEntry>,
    counts: [u64; 2],
}

struct OpenShard {
    file: String,
    out: BufWriter<File>,
    hasher: Sha256,
    tokens: u64,
}

impl ShardWriters<'_> {
    fn write(&mut self, split: Split, tokens: &[u32]) -> anyhow::Result<()> {
        let mut rest = tokens;
        while !rest.is_empty() {
            let slot = split as usize;
            if self.open[slot].is_none() {
                let file = format!("{split}-{:05}.bin", self.counts[slot]);
                self.counts[slot] += 1;
                let path = self.dir.join(&file);
                let out = File::create(&path)
                    .with_context(|| format!("cannot create {}", path.display()))?;
                self.open[slot] = Some(OpenShard {
                    file,
                    out: BufWriter::with_capacity(1 << 20, out),
                    hasher: Sha256::new(),
                    tokens: 0,
                });
            }
            let shard = self.open[slot].as_mut().expect("opened above");
            let room = (self.max_tokens - shard.tokens) as usize;
            let (now, later) = rest.split_at(room.min(rest.len()));
            let bytes: Vec<u8> = match self.dtype {
                TokenDtype::U16 => now.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect(),
                TokenDtype::U32 => now.iter().flat_map(|&t| t.to_le_bytes()).collect(),
            };
            shard.out.write_all(&bytes)?;
            shard.hasher.update(&bytes);
            shard.tokens += now.len() as u64;
            if shard.tokens == self.max_tokens {
                self.close(split)?;
            }
            rest = later;
        }
        Ok(())
    }

    fn close(&mut self, split: Split) -> anyhow::Result<()> {
        if let Some(shard) = self.open[split as usize].take() {
            let mut out = shard.out;
            out.flush()?;
            out.get_ref().sync_all()?;
            self.done.push(ShardEntry {
                split,
                file: shard.file,
                tokens: shard.tokens,
                sha256: hex(&shard.hasher.finalize()),
            });
        }
        Ok(())
    }
}

/// Encodes every document and writes the shards into `dir`: the shard entries, the documents
/// per split and the number skipped.
fn write_shards(
    files: &[PathBuf],
    tokenizer: &Tokenizer,
    end_of_text: u32,
    dtype: TokenDtype,
    dir: &Path,
    options: &PrepareOptions,
    total_bytes: u64,
) -> anyhow::Result<(Vec<ShardEntry>, DocumentCounts, u64)> {
    let mut writers = ShardWriters {
        dir,
        dtype,
        max_tokens: options.shard_tokens,
        open: [None, None],
        done: Vec::new(),
        counts: [0, 0],
    };
    let mut documents = DocumentCounts::default();
    let mut skipped = 0;
    let mut progress = Progress::new(total_bytes, options.progress);
    let mut index = 0u64;
    for file in files {
        let docs = read_documents(file, options)?;
        let bytes: u64 = docs
            .iter()
            .map(|d| d.text.as_ref().map_or(0, |t| t.len() as u64))
            .sum();
        let encoded: Vec<Option<Vec<u32>>> = (docs.par_iter())
            .map(|document| {
                let Some(text) = &document.text else {
                    return Ok(None);
                };
                let encode = |piece: &str| tokenizer.encode(piece);
                let parts: Result<Vec<Vec<u32>>, _> =
                    pieces(text).into_par_iter().map(encode).collect();
                let mut tokens: Vec<u32> = parts
                    .with_context(|| format!("{} does not fit the tokenizer", document.origin))?
                    .concat();
                tokens.push(end_of_text);
                Ok(Some(tokens))
            })
            .collect::<anyhow::Result<_>>()?;
        for tokens in encoded {
            let Some(tokens) = tokens else {
                skipped += 1;
                continue;
            };
            let split = match is_validation(options.seed, index, options.val_fraction) {
                true => Split::Val,
                false => Split::Train,
            };
            index += 1;
            match split {
                Split::Train => documents.train += 1,
                Split::Val => documents.val += 1,
            }
            writers.write(split, &tokens)?;
            progress.advance(0, tokens.len() as u64);
        }
        progress.advance(bytes, 0);
    }
    writers.close(Split::Train)?;
    writers.close(Split::Val)?;
    progress.finish();
    if documents.train == 0 {
        bail!(
            "the inputs hold no document for training ({} held out for validation, {skipped} \
             skipped)",
            documents.val
        );
    }
    if options.val_fraction > 0.0 && documents.val == 0 {
        bail!(
            "--val-fraction {} held out none of the {} documents: lower it to 0, or give more \
             documents",
            options.val_fraction,
            documents.train
        );
    }
    Ok((writers.done, documents, skipped))
}

/// A progress line on stderr: bytes and tokens per second, and the time left.
struct Progress {
    total_bytes: u64,
    bytes: u64,
    tokens: u64,
    start: Instant,
    shown: Instant,
    enabled: bool,
}

impl Progress {
    fn new(total_bytes: u64, enabled: bool) -> Self {
        let now = Instant::now();
        Self {
            total_bytes,
            bytes: 0,
            tokens: 0,
            start: now,
            shown: now,
            enabled,
        }
    }

    fn advance(&mut self, bytes: u64, tokens: u64) {
        self.bytes += bytes;
        self.tokens += tokens;
        if self.enabled && self.shown.elapsed() >= Duration::from_millis(500) {
            self.shown = Instant::now();
            eprint!("\r{}", self.line());
        }
    }

    fn line(&self) -> String {
        let seconds = self.start.elapsed().as_secs_f64().max(1e-9);
        let rate = self.bytes as f64 / seconds;
        let left = (self.total_bytes.saturating_sub(self.bytes)) as f64 / rate.max(1.0);
        format!(
            "prepare: {:.1} of {:.1} MB, {:.1} MB/s, {:.2} M tokens/s, ETA {:.0} s   ",
            self.bytes as f64 / 1e6,
            self.total_bytes as f64 / 1e6,
            rate / 1e6,
            self.tokens as f64 / seconds / 1e6,
            left
        )
    }

    fn finish(&self) {
        if self.enabled {
            eprintln!(
                "\r{}\nprepare: {} tokens in {:.1} s",
                self.line(),
                self.tokens,
                self.start.elapsed().as_secs_f64()
            );
        }
    }
}
