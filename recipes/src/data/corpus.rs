//! Reading a corpus (one file, or every file of a directory) and splitting it into training and
//! held-out validation tokens.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// The default config's corpus path, relative to a checkout's root.
pub const BUNDLED_CORPUS_PATH: &str = "recipes/data/shakespeare.txt";
/// The bundled corpus, built into the binary so the default recipe runs from any directory.
const BUNDLED_CORPUS: &str = include_str!("../../data/shakespeare.txt");

/// The text of `path`: the file itself, or the files of a directory (recursively) joined in
/// path order. Non-UTF-8 files are an error naming the file, never skipped silently. The
/// default corpus path falls back to the copy built into the binary when it is not there.
pub fn load_text(path: &Path) -> anyhow::Result<String> {
    if path == Path::new(BUNDLED_CORPUS_PATH) && !path.exists() {
        return Ok(BUNDLED_CORPUS.to_string());
    }
    let metadata =
        fs::metadata(path).with_context(|| format!("corpus {} cannot be read", path.display()))?;
    let files = if metadata.is_dir() {
        let mut files = Vec::new();
        collect_files(path, &mut files)?;
        files.sort();
        files
    } else {
        vec![path.to_path_buf()]
    };
    let mut text = String::new();
    for file in &files {
        let bytes = fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
        let part = String::from_utf8(bytes)
            .with_context(|| format!("corpus file {} is not UTF-8 text", file.display()))?;
        text.push_str(&part);
    }
    if text.is_empty() {
        bail!("corpus {} holds no text", path.display());
    }
    Ok(text)
}

/// Every file under `dir` (recursively; dot files and symlinked directories left out), unsorted.
pub(super) fn collect_files(dir: &Path, files: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let entry = entry?;
        let path = entry.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with('.') {
            continue;
        }
        // Real directories are entered; symlinks to directories are not (no cycles), symlinks
        // to files are read.
        if entry.file_type()?.is_dir() {
            collect_files(&path, files)?;
        } else if path.is_file() {
            files.push(path);
        }
    }
    Ok(())
}

/// Token ids split into a training part and a held-out validation tail.
#[derive(Debug, Clone)]
pub struct Splits {
    pub train: Vec<u32>,
    pub val: Vec<u32>,
}

impl Splits {
    /// The last `val_fraction` of the tokens is validation data. Each part must hold at least one
    /// window of `context + 1` tokens (inputs plus the shifted targets).
    pub fn new(tokens: Vec<u32>, val_fraction: f64, context: usize) -> anyhow::Result<Self> {
        if !(0.0..1.0).contains(&val_fraction) {
            bail!("data.val_fraction = {val_fraction} is outside [0, 1)");
        }
        let total = tokens.len();
        let n_val = (total as f64 * val_fraction).round() as usize;
        let mut train = tokens;
        let val = train.split_off(total - n_val);
        let window = context + 1;
        if train.len() < window || (val_fraction > 0.0 && val.len() < window) {
            bail!(
                "corpus of {total} tokens is too short: training keeps {} and validation {} \
                 (data.val_fraction = {val_fraction}), each needs at least context + 1 = {window}",
                train.len(),
                val.len()
            );
        }
        Ok(Self { train, val })
    }
}
