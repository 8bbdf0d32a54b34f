//! Hugging Face interoperability for both model kinds: `--init-from hf:PATH` reads a GPT-2 or
//! Llama checkpoint (one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`; PATH a file, an index or a model directory), and [`export`]
//! writes one with its `config.json` that `transformers` loads as `GPT2LMHeadModel` or
//! `LlamaForCausalLM`. Names and layouts: [`names`]; the config: [`config`]; the files:
//! [`files`]. From a model directory the sizes come from its `config.json` ([`model_config`]).
//!
//! On import every parameter of the model must be in the file with its shape, and every tensor
//! of the file must be a parameter (GPT-2's mask buffers, Llama's cached rotary frequencies and
//! a tied model's `lm_head` aside), else the error names the tensors.

pub mod config;
pub mod files;
pub mod names;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use burn::backend::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use wildfire_parallel::checkpoint::module::ModuleLayout;

use crate::data::{GPT2_VOCAB, Tokenizer};
use crate::model::params::collect_params;
use crate::model::{Gpt, GptConfig, ModelKind};
use names::{hf_name, is_ignored, is_transposed, without_prefix};

/// Shards of at most 5 GB, Hugging Face's default (`save_pretrained`'s `max_shard_size`).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

fn transpose(data: TensorData) -> TensorData {
    Tensor::<Flex, 2>::from_data(data, &Default::default())
        .transpose()
        .into_data()
}

/// The weights path of a `run.init_from` value `hf:PATH`.
pub fn source_path(source: &str) -> anyhow::Result<&Path> {
    match source.strip_prefix("hf:") {
        Some(path) => Ok(Path::new(path)),
        None => bail!(
            "run.init_from = {source:?}: expected hf:PATH (a model directory, a .safetensors file \
             or a model.safetensors.index.json)"
        ),
    }
}

/// `model` (of `config`) with the weights named by `source` (`hf:PATH`).
pub fn init_from<B: Backend>(
    model: Gpt<B>,
    config: &GptConfig,
    source: &str,
) -> anyhow::Result<Gpt<B>> {
    import(model, config, source_path(source)?)
}

/// The sizes of the model that `source` (`hf:DIR`) holds, from `DIR/config.json`, with
/// `dropout`; `None` when `source` names a file (its sizes come from the run's config).
pub fn model_config(source: &str, dropout: f64) -> anyhow::Result<Option<GptConfig>> {
    let dir = source_path(source)?;
    if !dir.is_dir() {
        return Ok(None);
    }
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let json =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    config::from_json(&json, dropout)
        .with_context(|| format!("{}", path.display()))
        .map(Some)
}

/// Loads the Hugging Face weights at `path` into the whole `model` of `config`, whose sizes
/// must match the file's.
pub fn import<B: Backend>(
    model: Gpt<B>,
    config: &GptConfig,
    path: &Path,
) -> anyhow::Result<Gpt<B>> {
    let kind = config.kind;
    // Hugging Face name → (our name, the shape the file must have).
    let ours_by_hf: HashMap<String, (String, Vec<usize>)> =
        collect_params(&model, model.first_block)
            .into_iter()
            .map(|(name, _, data)| {
                let hf = hf_name(kind, &name);
                let mut shape = data.shape.to_vec();
                if is_transposed(kind, &hf) {
                    shape.reverse();
                }
                (hf, (name, shape))
            })
            .collect();
    let mut tensors = BTreeMap::new();
    let mut unknown = Vec::new();
    for (key, data) in files::read_tensors(path)? {
        let hf = without_prefix(kind, &key);
        if is_ignored(hf, config.tie_embeddings) {
            continue;
        }
        let Some((ours, shape)) = ours_by_hf.get(hf) else {
            unknown.push(key);
            continue;
        };
        if data.shape.as_slice() != shape.as_slice() {
            bail!(
                "{}: tensor {key} has shape {:?}, this {} expects {shape:?} (do the model sizes \
                 match the file's?)",
                path.display(),
                data.shape,
                kind
            );
        }
        let data = match is_transposed(kind, hf) {
            true => transpose(data),
            false => data,
        };
        tensors.insert(ours.clone(), data);
    }
    if !unknown.is_empty() {
        bail!(
            "{}: tensors {} have no counterpart in this {kind} (do the model sizes match the \
             file's?)",
            path.display(),
            unknown.join(", ")
        );
    }
    let source = || path.display().to_string();
    ModuleLayout::load_whole(model, &tensors).with_context(source)
}

/// Writes `model` (of `config`) as Hugging Face weights plus `config.json` (and `tokenizer`'s
/// `tokenizer.json` when it is a Hugging Face one): to `out` itself when it ends in
/// `.safetensors` (the JSON files beside it), else into the directory `out`, as one
/// `model.safetensors` or, above `max_shard_bytes`, shards and their index. Returns the weights
/// file or the index.
pub fn export<B: Backend>(
    model: &Gpt<B>,
    config: &GptConfig,
    tokenizer: &Tokenizer,
    out: &Path,
    max_shard_bytes: u64,
) -> anyhow::Result<PathBuf> {
    let hf_config = config::to_json(config)?;
    let single = out.extension().is_some_and(|e| e == "safetensors");
    let dir = match single {
        true => out.parent().map(Path::to_path_buf).unwrap_or_default(),
        false => out.to_path_buf(),
    };
    if !dir.as_os_str().is_empty() {
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let tensors: Vec<(String, TensorData)> = collect_params(model, model.first_block)
        .into_iter()
        .map(|(name, _, data)| {
            let hf = hf_name(config.kind, &name);
            let data = data.convert_dtype(DType::F32);
            match is_transposed(config.kind, &hf) {
                true => (hf, transpose(data)),
                false => (hf, data),
            }
        })
        .collect();
    let written = match single {
        true => files::write_tensors(&dir, &tensors, u64::MAX).and_then(|path| {
            std::fs::rename(&path, out)
                .with_context(|| format!("cannot move {} to {}", path.display(), out.display()))?;
            Ok(out.to_path_buf())
        })?,
        false => files::write_tensors(&dir, &tensors, max_shard_bytes)?,
    };
    let json_files = [
        (
            "config.json",
            Some(serde_json::to_string_pretty(&hf_config)?),
        ),
        ("tokenizer.json", tokenizer.hf_json().map(str::to_string)),
    ];
    for (name, text) in json_files {
        if let Some(text) = text {
            let path = dir.join(name);
            std::fs::write(&path, text)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
    }
    Ok(written)
}

/// The tokenizer of the Hugging Face model directory `dir` (of `config`): its
/// `tokenizer.json`, else, for a GPT-2 of GPT-2's 50,257 tokens, GPT-2's own BPE.
pub fn tokenizer(dir: &Path, config: &GptConfig) -> anyhow::Result<Tokenizer> {
    let path = dir.join("tokenizer.json");
    if path.exists() {
        return Ok(Tokenizer::hugging_face(&path)?);
    }
    if config.kind == ModelKind::Gpt && config.vocab_size == GPT2_VOCAB {
        return Ok(Tokenizer::gpt2()?);
    }
    bail!(
        "{} has no tokenizer.json, and its {} of {} tokens is not GPT-2 (whose tokenizer ships \
         with wildfire)",
        dir.display(),
        config.kind,
        config.vocab_size
    )
}
