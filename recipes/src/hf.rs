//! Hugging Face GPT-2 interoperability: `--init-from hf:PATH` reads a GPT-2 `model.safetensors`,
//! and [`export`] writes one (with its `config.json`) that `transformers` loads as
//! `GPT2LMHeadModel`.
//!
//! The mapping is a rename, because the model uses GPT-2's own module names:
//! - `embeddings.wte|wpe.*` ↔ `wte|wpe.*`, `blocks.{i}.*` ↔ `h.{i}.*`, `head.ln_f.*` ↔ `ln_f.*`;
//! - LayerNorm `gamma`/`beta` ↔ `weight`/`bias`;
//! - GPT-2's Conv1D stores weights `[in, out]` and so does Burn's `Linear`: no transpose, and the
//!   fused `c_attn` keeps its `[q | k | v]` column order, which the attention splits the same way;
//! - an untied `lm_head` is an `nn.Linear` (`[out, in]`) in PyTorch, so it is transposed.
//!
//! On import, a `transformer.` prefix is accepted, the `attn.bias`/`attn.masked_bias` mask
//! buffers are ignored, and `lm_head.weight` is ignored when the head is tied (it is `wte`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use burn::backend::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use safetensors::SafeTensors;
use wildfire_parallel::checkpoint::module::ModuleLayout;

use crate::model::params::collect_params;
use crate::model::{Gpt, GptConfig};

const PREFIX: &str = "transformer.";

/// Our parameter name → Hugging Face's (without the `transformer.` prefix).
pub fn hf_name(ours: &str) -> String {
    let renamed = if let Some(rest) = ours.strip_prefix("embeddings.") {
        rest.to_string()
    } else if let Some(rest) = ours.strip_prefix("blocks.") {
        format!("h.{rest}")
    } else if let Some(rest) = ours.strip_prefix("head.") {
        rest.to_string()
    } else {
        ours.to_string()
    };
    if let Some(stem) = renamed.strip_suffix(".gamma") {
        format!("{stem}.weight")
    } else if let Some(stem) = renamed.strip_suffix(".beta") {
        format!("{stem}.bias")
    } else {
        renamed
    }
}

fn is_lm_head(hf: &str) -> bool {
    hf == "lm_head.weight"
}

fn transpose(data: TensorData) -> TensorData {
    Tensor::<Flex, 2>::from_data(data, &Default::default())
        .transpose()
        .into_data()
}

/// `model` with the weights of the GPT-2 safetensors file named by `source` (`hf:PATH`).
pub fn init_from<B: Backend>(model: Gpt<B>, source: &str) -> anyhow::Result<Gpt<B>> {
    let Some(path) = source.strip_prefix("hf:") else {
        bail!("run.init_from = {source:?}: expected hf:PATH/to/model.safetensors");
    };
    import(model, Path::new(path))
}

/// Loads a GPT-2 `model.safetensors` into the whole `model`, whose sizes must match the file's.
pub fn import<B: Backend>(model: Gpt<B>, path: &Path) -> anyhow::Result<Gpt<B>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file = SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{} is not a safetensors file", path.display()))?;
    // Hugging Face name → (our name, the shape the file must have).
    let ours_by_hf: HashMap<String, (String, Vec<usize>)> =
        collect_params(&model, model.first_block)
            .into_iter()
            .map(|(name, _, data)| {
                let hf = hf_name(&name);
                let mut shape = data.shape.to_vec();
                if is_lm_head(&hf) {
                    shape.reverse();
                }
                (hf, (name, shape))
            })
            .collect();
    let tied = model.head.as_ref().is_some_and(|h| h.lm_head.is_none());
    let mut tensors = BTreeMap::new();
    let mut unknown = Vec::new();
    for (key, view) in file.tensors() {
        let hf = key.strip_prefix(PREFIX).unwrap_or(&key);
        if hf.ends_with(".attn.bias")
            || hf.ends_with(".attn.masked_bias")
            || (tied && is_lm_head(hf))
        {
            continue;
        }
        let Some((ours, shape)) = ours_by_hf.get(hf) else {
            unknown.push(key);
            continue;
        };
        let dtype = match view.dtype() {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            other => bail!(
                "{}: tensor {key} has dtype {other:?}; expected F32, F16 or BF16",
                path.display()
            ),
        };
        if view.shape() != shape.as_slice() {
            bail!(
                "{}: tensor {key} has shape {:?}, this GPT expects {shape:?} (do the model sizes \
                 match the file's?)",
                path.display(),
                view.shape()
            );
        }
        let data = TensorData::from_bytes_vec(view.data().to_vec(), view.shape().to_vec(), dtype)
            .convert_dtype(DType::F32);
        let data = if is_lm_head(hf) {
            transpose(data)
        } else {
            data
        };
        tensors.insert(ours.clone(), data);
    }
    if !unknown.is_empty() {
        unknown.sort();
        bail!(
            "{}: tensors {} have no counterpart in this GPT (do the model sizes match the file's?)",
            path.display(),
            unknown.join(", ")
        );
    }
    let source = || path.display().to_string();
    ModuleLayout::load_whole(model, &tensors).with_context(source)
}

/// Hugging Face's `config.json` for a GPT2LMHeadModel of these sizes.
pub fn hf_config(config: &GptConfig) -> anyhow::Result<serde_json::Value> {
    if !config.bias {
        bail!("model.bias = false cannot be exported: GPT2LMHeadModel always has biases");
    }
    Ok(serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.context,
        "n_ctx": config.context,
        "n_embd": config.d_model,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "scale_attn_weights": true,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "torch_dtype": "float32"
    }))
}

/// Where `export --out PATH` writes: `PATH` itself when it ends in `.safetensors` (config.json
/// beside it), else `PATH/model.safetensors` and `PATH/config.json`.
pub fn export_paths(out: &Path) -> (PathBuf, PathBuf) {
    if out.extension().is_some_and(|e| e == "safetensors") {
        let dir = out.parent().map(Path::to_path_buf).unwrap_or_default();
        (out.to_path_buf(), dir.join("config.json"))
    } else {
        (out.join("model.safetensors"), out.join("config.json"))
    }
}

/// Writes `model` as a Hugging Face GPT-2 safetensors file plus `config.json`.
pub fn export<B: Backend>(
    model: &Gpt<B>,
    config: &GptConfig,
    out: &Path,
) -> anyhow::Result<PathBuf> {
    let hf_config = hf_config(config)?;
    let (weights, config_path) = export_paths(out);
    if let Some(dir) = weights.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let tensors: Vec<(String, TensorData)> = collect_params(model, model.first_block)
        .into_iter()
        .map(|(name, _, data)| {
            let hf = hf_name(&name);
            let data = if is_lm_head(&hf) {
                transpose(data)
            } else {
                data.convert_dtype(DType::F32)
            };
            (hf, data)
        })
        .collect();
    let views = tensors
        .iter()
        .map(|(name, data)| {
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                data.shape.to_vec(),
                data.as_bytes(),
            )
            .map(|view| (name.clone(), view))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), &weights)
        .with_context(|| format!("cannot write {}", weights.display()))?;
    std::fs::write(&config_path, serde_json::to_string_pretty(&hf_config)?)
        .with_context(|| format!("cannot write {}", config_path.display()))?;
    Ok(weights)
}
