//! Hugging Face's `config.json` for the two model kinds: written beside an export, and read
//! to take a model's sizes from its directory (`--init-from hf:DIR`).
//!
//! Reading is strict: a field that would change the architecture and that the model does not
//! implement (another activation, another rope type, a sliding window, …) is refused, naming
//! the field, rather than ignored; fields that do not change the computation (token ids,
//! dtypes, initialisation, caching) are ignored.

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::model::{GptConfig, Llama3Scaling, ModelKind, Preset};

/// `config.json` of a `GPT2LMHeadModel` or a `LlamaForCausalLM` of these sizes.
pub fn to_json(config: &GptConfig) -> anyhow::Result<Value> {
    match config.kind {
        ModelKind::Gpt => gpt2_json(config),
        ModelKind::Llama => Ok(llama_json(config)),
    }
}

fn gpt2_json(config: &GptConfig) -> anyhow::Result<Value> {
    if !config.bias {
        bail!("model.bias = false cannot be exported: GPT2LMHeadModel always has biases");
    }
    Ok(json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.context,
        "n_ctx": config.context,
        "n_embd": config.d_model,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": config.ffn_hidden,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": config.norm_eps,
        "initializer_range": 0.02,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "scale_attn_weights": true,
        "tie_word_embeddings": config.tie_embeddings,
        // GPT-2's end-of-text token, where the vocabulary has it (a character-level one does not).
        "bos_token_id": (config.vocab_size > 50256).then_some(50256),
        "eos_token_id": (config.vocab_size > 50256).then_some(50256),
        "torch_dtype": "float32"
    }))
}

fn llama_json(config: &GptConfig) -> Value {
    let rope_scaling = config.rope_scaling.map(|s| {
        json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_context,
        })
    });
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim(),
        "max_position_embeddings": config.context,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": config.bias,
        "mlp_bias": config.bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "torch_dtype": "float32"
    })
}

/// Fields that do not change what the model computes.
const IGNORED: &[&str] = &[
    "architectures",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "use_cache",
    "_name_or_path",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
    "task_specific_params",
];

/// The model a `config.json` describes, with `dropout` (a training choice, not a size).
pub fn from_json(json: &Value, dropout: f64) -> anyhow::Result<GptConfig> {
    let fields = Fields(
        json.as_object()
            .context("config.json is not a JSON object")?,
    );
    let config = match fields.str("model_type")? {
        "gpt2" => gpt2_from(&fields, dropout)?,
        "llama" => llama_from(&fields, dropout)?,
        other => bail!("config.json: model_type {other:?} is not supported (gpt2 or llama)"),
    };
    config
        .validate()
        .context("config.json describes a model wildfire cannot build")?;
    Ok(config)
}

struct Fields<'a>(&'a serde_json::Map<String, Value>);

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn str(&self, key: &str) -> anyhow::Result<&str> {
        self.get(key)
            .and_then(Value::as_str)
            .with_context(|| format!("config.json: {key} is missing or not a string"))
    }

    fn size(&self, key: &str) -> anyhow::Result<usize> {
        self.get(key)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .with_context(|| format!("config.json: {key} is missing or not a whole number"))
    }

    fn number(&self, key: &str) -> anyhow::Result<Option<f64>> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .with_context(|| format!("config.json: {key} = {v} is not a number"))
            })
            .transpose()
    }

    fn flag(&self, key: &str) -> anyhow::Result<Option<bool>> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .with_context(|| format!("config.json: {key} = {v} is not true or false"))
            })
            .transpose()
    }

    /// Refuses a field outside `known` and [`IGNORED`], naming it.
    fn only(&self, known: &[&str]) -> anyhow::Result<()> {
        for (key, value) in self.0 {
            let dropout = key.ends_with("dropout") || key.ends_with("pdrop");
            if !(known.contains(&key.as_str()) || IGNORED.contains(&key.as_str()) || dropout) {
                bail!("config.json: field {key} = {value} is not supported by wildfire's model");
            }
        }
        Ok(())
    }

    /// Refuses `key` unless it is absent or `expected`.
    fn expect(&self, key: &str, expected: Value) -> anyhow::Result<()> {
        match self.get(key) {
            Some(value) if *value != expected => bail!(
                "config.json: {key} = {value} is not supported (wildfire's model has {expected})"
            ),
            _ => Ok(()),
        }
    }
}

fn gpt2_from(f: &Fields, dropout: f64) -> anyhow::Result<GptConfig> {
    f.only(&[
        "vocab_size",
        "n_positions",
        "n_ctx",
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
        "activation_function",
        "layer_norm_epsilon",
        "scale_attn_weights",
        "tie_word_embeddings",
        "scale_attn_by_inverse_layer_idx",
        "reorder_and_upcast_attn",
    ])?;
    f.expect("activation_function", json!("gelu_new"))?;
    f.expect("scale_attn_weights", json!(true))?;
    f.expect("scale_attn_by_inverse_layer_idx", json!(false))?;
    let d_model = f.size("n_embd")?;
    Ok(GptConfig {
        vocab_size: f.size("vocab_size")?,
        n_layer: f.size("n_layer")?,
        n_head: f.size("n_head")?,
        n_kv_head: f.size("n_head")?,
        d_model,
        ffn_hidden: f
            .get("n_inner")
            .map_or(Ok(4 * d_model), |_| f.size("n_inner"))?,
        context: f.size("n_positions")?,
        dropout,
        tie_embeddings: f.flag("tie_word_embeddings")?.unwrap_or(true),
        norm_eps: f.number("layer_norm_epsilon")?.unwrap_or(1e-5),
        ..Preset::Tiny.config(0)
    })
}

fn llama_from(f: &Fields, dropout: f64) -> anyhow::Result<GptConfig> {
    f.only(&[
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "hidden_act",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "attention_bias",
        "mlp_bias",
        "tie_word_embeddings",
        "pretraining_tp",
    ])?;
    f.expect("hidden_act", json!("silu"))?;
    f.expect("pretraining_tp", json!(1))?;
    let (d_model, n_head) = (f.size("hidden_size")?, f.size("num_attention_heads")?);
    if f.get("head_dim").is_some() && f.size("head_dim")? * n_head != d_model {
        bail!(
            "config.json: head_dim = {} is not hidden_size / num_attention_heads = {d_model} / \
             {n_head}: wildfire's model needs them equal",
            f.size("head_dim")?
        );
    }
    let attention_bias = f.flag("attention_bias")?.unwrap_or(false);
    let mlp_bias = f.flag("mlp_bias")?.unwrap_or(attention_bias);
    if attention_bias != mlp_bias {
        bail!(
            "config.json: attention_bias = {attention_bias} and mlp_bias = {mlp_bias}: wildfire's \
             model has biases in both or neither"
        );
    }
    Ok(GptConfig {
        kind: ModelKind::Llama,
        vocab_size: f.size("vocab_size")?,
        n_layer: f.size("num_hidden_layers")?,
        n_head,
        n_kv_head: f
            .get("num_key_value_heads")
            .map_or(Ok(n_head), |_| f.size("num_key_value_heads"))?,
        d_model,
        ffn_hidden: f.size("intermediate_size")?,
        context: f.size("max_position_embeddings")?,
        dropout,
        bias: attention_bias,
        tie_embeddings: f.flag("tie_word_embeddings")?.unwrap_or(false),
        rope_theta: f.number("rope_theta")?.unwrap_or(10_000.0),
        rope_scaling: f.get("rope_scaling").map(rope_scaling).transpose()?,
        norm_eps: f.number("rms_norm_eps")?.unwrap_or(1e-6),
    })
}

fn rope_scaling(json: &Value) -> anyhow::Result<Llama3Scaling> {
    let f = Fields(
        json.as_object()
            .context("config.json: rope_scaling is not an object")?,
    );
    let kind = f
        .get("rope_type")
        .or(f.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("");
    if kind != "llama3" {
        bail!("config.json: rope_scaling.rope_type = {kind:?} is not supported (llama3 is)");
    }
    let number = |key: &str| {
        f.number(key)?
            .with_context(|| format!("config.json: rope_scaling.{key} is missing"))
    };
    Ok(Llama3Scaling {
        factor: number("factor")?,
        low_freq_factor: number("low_freq_factor")?,
        high_freq_factor: number("high_freq_factor")?,
        original_context: f.size("original_max_position_embeddings")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both kinds' presets through config.json and back, unchanged.
    #[test]
    fn configs_round_trip() {
        for preset in [
            Preset::Gpt2,
            Preset::LlamaTiny,
            Preset::Llama1b,
            Preset::Llama8b,
        ] {
            let config = preset.config(1000);
            let json = to_json(&config).unwrap();
            assert_eq!(from_json(&json, 0.0).unwrap(), config, "{preset:?}");
        }
    }

    /// Llama 3.2 1B's published config.json (the fields that matter, as Hugging Face ships them)
    /// gives the llama-1b preset; an unknown field or another rope type is refused by name.
    #[test]
    fn llama_3_2_config_reads_as_the_preset() {
        let published = json!({
            "architectures": ["LlamaForCausalLM"], "attention_bias": false,
            "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001,
            "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
            "initializer_range": 0.02, "intermediate_size": 8192,
            "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
            "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
            "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256
        });
        let config = from_json(&published, 0.0).unwrap();
        let preset = Preset::Llama1b.config(128_256);
        assert_eq!(
            config,
            GptConfig {
                context: 131_072,
                ..preset
            }
        );
        let mut odd = published.clone();
        odd["sliding_window"] = json!(4096);
        let err = from_json(&odd, 0.0).unwrap_err().to_string();
        assert!(err.contains("field sliding_window = 4096"), "{err}");
        let mut odd = published;
        odd["rope_scaling"]["rope_type"] = json!("yarn");
        let err = from_json(&odd, 0.0).unwrap_err().to_string();
        assert!(err.contains("rope_type = \"yarn\""), "{err}");
    }
}
