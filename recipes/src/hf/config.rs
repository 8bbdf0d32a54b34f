//! Hugging Face's `config.json` for the two model kinds: written beside an export, and read
//! to take a model's sizes from its directory (`--init-from hf:DIR`). The Llama kind also reads
//! and writes the families that are Llama's block with a setting of its own ([`Family`]): Qwen2
//! (biases on Q, K and V alone), Qwen3 (an RMSNorm of each head of Q and K) and Mistral (a
//! sliding window).
//!
//! Reading is strict: a field that would change the architecture and that the model does not
//! implement (another activation, another rope type, a sliding window, …) is refused, naming
//! the field, rather than ignored; fields that do not change the computation (token ids,
//! dtypes, initialisation, caching, a sliding window switched off, every layer's type the full
//! attention) are ignored.
//!
//! RoPE's settings come in two forms, both read: transformers ≥ 5 writes one `rope_parameters`
//! object (`rope_type`, `rope_theta` and the scaling fields together); older checkpoints have
//! `rope_theta` beside a `rope_scaling` object. Export writes what transformers 5 writes:
//! `rope_parameters`, and `dtype` where older versions wrote `torch_dtype`.

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::model::{GptConfig, Llama3Scaling, ModelKind, Preset};

/// `config.json` of a `GPT2LMHeadModel`, or of the Llama kind's family that has these
/// settings: `LlamaForCausalLM`, `Qwen2ForCausalLM` (biases on Q, K and V alone) or
/// `MistralForCausalLM` (a sliding window).
pub fn to_json(config: &GptConfig) -> anyhow::Result<Value> {
    match config.kind {
        ModelKind::Gpt => gpt2_json(config),
        ModelKind::Llama => llama_kind_json(config),
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
        "dtype": "float32"
    }))
}

/// RoPE's settings as transformers 5 writes them.
fn rope_parameters(config: &GptConfig) -> Value {
    match config.rope_scaling {
        None => json!({"rope_type": "default", "rope_theta": config.rope_theta}),
        Some(s) => json!({
            "rope_type": "llama3",
            "rope_theta": config.rope_theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_context,
        }),
    }
}

/// `config.json` of a model of the Llama kind, as its family writes it: Llama's fields, and
/// those that tell the family apart (see [`Family`]).
fn llama_kind_json(config: &GptConfig) -> anyhow::Result<Value> {
    let family = Family::of(config)?;
    let (architecture, model_type) = family.names();
    let mut json = json!({
        "architectures": [architecture],
        "model_type": model_type,
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
        "rope_parameters": rope_parameters(config),
        "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": 0.02,
        "dtype": "float32"
    });
    let own = match family {
        Family::Llama => json!({
            "attention_bias": config.bias, "mlp_bias": config.bias, "pretraining_tp": 1
        }),
        Family::Qwen2 => json!({"use_sliding_window": false}),
        Family::Mistral => json!({"sliding_window": config.sliding_window}),
        Family::Qwen3 => json!({"attention_bias": false, "use_sliding_window": false}),
    };
    let fields = json.as_object_mut().expect("an object");
    fields.extend(own.as_object().expect("an object").clone());
    Ok(json)
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
        "llama" => llama_from(&fields, Family::Llama, dropout)?,
        "qwen2" => llama_from(&fields, Family::Qwen2, dropout)?,
        "mistral" => llama_from(&fields, Family::Mistral, dropout)?,
        "qwen3" => llama_from(&fields, Family::Qwen3, dropout)?,
        other => bail!(
            "config.json: model_type {other:?} is not supported (gpt2, llama, qwen2, qwen3 or \
             mistral)"
        ),
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

    /// Refuses a field of the object `name` outside `known`, naming it (a `partial_rotary_factor`
    /// of 1, RoPE on the whole head, is known everywhere).
    fn only_in(&self, name: &str, known: &[&str]) -> anyhow::Result<()> {
        for (key, value) in self.0 {
            let whole_head = key == "partial_rotary_factor" && value.as_f64() == Some(1.0);
            if !(known.contains(&key.as_str()) || whole_head) {
                bail!("config.json: {name}.{key} = {value} is not supported by wildfire's model");
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

/// The families of wildfire's Llama kind, by `model_type`.
#[derive(Clone, Copy, PartialEq)]
enum Family {
    Llama,
    /// Llama's block with biases on Q, K and V alone (Qwen2, Qwen2.5).
    Qwen2,
    /// Llama's block with a sliding window of attention (Mistral 7B v0.1).
    Mistral,
    /// Llama's block with an RMSNorm of each head of Q and K (Qwen3).
    Qwen3,
}

impl Family {
    /// The family that holds a Llama-kind model of `config`, refusing settings none has.
    fn of(config: &GptConfig) -> anyhow::Result<Self> {
        if config.qk_norm {
            return match (config.sliding_window, config.qkv_bias, config.bias) {
                (None, false, false) => Ok(Self::Qwen3),
                (window, qkv_bias, bias) => bail!(
                    "model.qk_norm with model.sliding_window = {window:?}, model.qkv_bias = \
                     {qkv_bias} and model.bias = {bias}: Qwen3, the family with the norms, has \
                     no window and no biases"
                ),
            };
        }
        match (config.sliding_window, config.qkv_bias, config.bias) {
            (None, true, false) => Ok(Self::Qwen2),
            (None, _, _) => Ok(Self::Llama),
            (Some(_), false, false) => Ok(Self::Mistral),
            (Some(window), qkv_bias, bias) => bail!(
                "model.sliding_window = {window} with model.qkv_bias = {qkv_bias} and \
                 model.bias = {bias}: no Hugging Face family has a window with biases"
            ),
        }
    }

    /// The class and `model_type` transformers knows the family by.
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Self::Llama => ("LlamaForCausalLM", "llama"),
            Self::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
            Self::Mistral => ("MistralForCausalLM", "mistral"),
            Self::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
        }
    }
}

fn llama_from(f: &Fields, family: Family, dropout: f64) -> anyhow::Result<GptConfig> {
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
        "rope_parameters",
        "attention_bias",
        "mlp_bias",
        "tie_word_embeddings",
        "pretraining_tp",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
    ])?;
    f.expect("hidden_act", json!("silu"))?;
    f.expect("pretraining_tp", json!(1))?;
    let sliding_window = match family {
        // Mistral's window applies to every layer (null: none).
        Family::Mistral => {
            for key in ["use_sliding_window", "max_window_layers", "layer_types"] {
                if let Some(value) = f.get(key) {
                    bail!("config.json: field {key} = {value} is not Mistral's");
                }
            }
            (f.get("sliding_window"))
                .map(|_| f.size("sliding_window"))
                .transpose()?
        }
        Family::Llama | Family::Qwen2 | Family::Qwen3 => {
            full_attention_everywhere(f)?;
            None
        }
    };
    let (d_model, n_head) = (f.size("hidden_size")?, f.size("num_attention_heads")?);
    let head_dim = (f.get("head_dim"))
        .map(|_| f.size("head_dim"))
        .transpose()?
        .and_then(|h| GptConfig::explicit_head_dim(d_model, n_head, h));
    let (attention_bias, qkv_bias) = match family {
        // Qwen2's Q, K and V always have biases, its output projection and MLP never; Mistral
        // has none.
        Family::Qwen2 | Family::Mistral => {
            let qwen2 = family == Family::Qwen2;
            for key in ["attention_bias", "mlp_bias"] {
                if let Some(value) = f.get(key) {
                    let (_, model_type) = family.names();
                    bail!("config.json: field {key} = {value} is not {model_type}'s");
                }
            }
            (false, qwen2)
        }
        // Qwen3's `attention_bias` would put biases on the output projection too, which
        // wildfire's model has only with biases everywhere.
        Family::Qwen3 => {
            f.expect("attention_bias", json!(false))?;
            if let Some(value) = f.get("mlp_bias") {
                bail!("config.json: field mlp_bias = {value} is not qwen3's");
            }
            (false, false)
        }
        Family::Llama => {
            let attention_bias = f.flag("attention_bias")?.unwrap_or(false);
            let mlp_bias = f.flag("mlp_bias")?.unwrap_or(attention_bias);
            if attention_bias != mlp_bias {
                bail!(
                    "config.json: attention_bias = {attention_bias} and mlp_bias = {mlp_bias}: \
                     wildfire's Llama has biases in both or neither"
                );
            }
            (attention_bias, false)
        }
    };
    let (rope_theta, rope_scaling) = rope(f)?;
    Ok(GptConfig {
        kind: ModelKind::Llama,
        vocab_size: f.size("vocab_size")?,
        n_layer: f.size("num_hidden_layers")?,
        n_head,
        n_kv_head: f
            .get("num_key_value_heads")
            .map_or(Ok(n_head), |_| f.size("num_key_value_heads"))?,
        d_model,
        head_dim,
        ffn_hidden: f.size("intermediate_size")?,
        context: f.size("max_position_embeddings")?,
        dropout,
        bias: attention_bias,
        qkv_bias,
        qk_norm: family == Family::Qwen3,
        tie_embeddings: f.flag("tie_word_embeddings")?.unwrap_or(false),
        rope_theta,
        rope_scaling,
        norm_eps: f.number("rms_norm_eps")?.unwrap_or(1e-6),
        sliding_window,
    })
}

/// Refuses any layer that attends other than fully and causally: a sliding window is accepted
/// only where it is switched off (`use_sliding_window: false`, as Qwen2's configs ship it), and
/// transformers 5's `layer_types` only with every layer `full_attention`.
fn full_attention_everywhere(f: &Fields) -> anyhow::Result<()> {
    if f.flag("use_sliding_window")? != Some(false) {
        for key in ["sliding_window", "max_window_layers"] {
            if let Some(value) = f.get(key) {
                bail!(
                    "config.json: field {key} = {value} is not supported by wildfire's model \
                     (a sliding window is accepted only with use_sliding_window = false)"
                );
            }
        }
    }
    f.expect("use_sliding_window", json!(false))?;
    if let Some(types) = f.get("layer_types") {
        let layers = f.size("num_hidden_layers")?;
        let uniform = (types.as_array()).is_some_and(|types| {
            types.len() == layers && types.iter().all(|t| t == "full_attention")
        });
        if !uniform {
            bail!(
                "config.json: layer_types = {types} is not supported: wildfire's model needs \
                 \"full_attention\" for each of its {layers} layers"
            );
        }
    }
    Ok(())
}

/// RoPE's base and Llama 3 scaling from either form (see the module doc). Both forms at once are
/// refused, as is any `rope_type` but `default` and `llama3`.
fn rope(f: &Fields) -> anyhow::Result<(f64, Option<Llama3Scaling>)> {
    let theta = f.number("rope_theta")?;
    let Some(parameters) = f.get("rope_parameters") else {
        let scaling = (f.get("rope_scaling"))
            .map(|json| llama3_scaling(json, "rope_scaling"))
            .transpose()?;
        return Ok((theta.unwrap_or(10_000.0), scaling));
    };
    if let Some(scaling) = f.get("rope_scaling") {
        bail!(
            "config.json: both rope_parameters = {parameters} and rope_scaling = {scaling}: \
             one form only (transformers 5 writes rope_parameters)"
        );
    }
    let p =
        Fields((parameters.as_object()).context("config.json: rope_parameters is not an object")?);
    let inner_theta = p.number("rope_theta")?;
    if let (Some(outer), Some(inner)) = (theta, inner_theta)
        && outer != inner
    {
        bail!("config.json: rope_theta = {outer} but rope_parameters.rope_theta = {inner}");
    }
    let theta = inner_theta.or(theta).unwrap_or(10_000.0);
    match rope_type(&p, "rope_parameters")? {
        "default" => {
            p.only_in("rope_parameters", &["rope_type", "type", "rope_theta"])?;
            Ok((theta, None))
        }
        _ => Ok((theta, Some(llama3_scaling(parameters, "rope_parameters")?))),
    }
}

/// The `rope_type` (or older `type`) of a RoPE object named `name`: `default` when absent,
/// refused unless `default` or `llama3`.
fn rope_type<'a>(f: &'a Fields, name: &str) -> anyhow::Result<&'a str> {
    let kind = (f.get("rope_type").or(f.get("type")))
        .map(|v| {
            v.as_str()
                .with_context(|| format!("config.json: {name}.rope_type = {v} is not a string"))
        })
        .transpose()?
        .unwrap_or("default");
    match kind {
        "default" | "llama3" => Ok(kind),
        other => bail!(
            "config.json: {name}.rope_type = {other:?} is not supported (default and llama3 are)"
        ),
    }
}

/// Llama 3's scaling from the RoPE object `json`, named `name` in errors (`rope_scaling`, or
/// `rope_parameters` with its `rope_theta` beside the scaling fields).
fn llama3_scaling(json: &Value, name: &str) -> anyhow::Result<Llama3Scaling> {
    let f = Fields(
        json.as_object()
            .with_context(|| format!("config.json: {name} is not an object"))?,
    );
    if rope_type(&f, name)? != "llama3" {
        bail!("config.json: {name}.rope_type = \"default\" scales nothing: drop {name}");
    }
    f.only_in(
        name,
        &[
            "rope_type",
            "type",
            "rope_theta",
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
    )?;
    let number = |key: &str| {
        f.number(key)?
            .with_context(|| format!("config.json: {name}.{key} is missing"))
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

    /// Why `config` with `change` made to it is refused on reading.
    fn refusal(config: &Value, change: impl FnOnce(&mut Value)) -> String {
        let mut changed = config.clone();
        change(&mut changed);
        from_json(&changed, 0.0).unwrap_err().to_string()
    }

    /// `config` written as a config.json of `model_type` that reads back as itself.
    fn assert_writes_back_as(config: &GptConfig, model_type: &str) {
        let written = to_json(config).unwrap();
        assert_eq!(written["model_type"], model_type);
        assert_eq!(from_json(&written, 0.0).unwrap(), *config);
    }

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

    /// What export writes is what transformers 5 writes: `dtype`, and RoPE as one
    /// `rope_parameters` object (`default` without scaling, `llama3` with it).
    #[test]
    fn export_writes_the_transformers_5_form() {
        for (preset, rope_type) in [(Preset::LlamaTiny, "default"), (Preset::Llama1b, "llama3")] {
            let config = preset.config(1000);
            let json = to_json(&config).unwrap();
            for old in ["torch_dtype", "rope_theta", "rope_scaling"] {
                assert!(json.get(old).is_none(), "{preset:?}: {old} in {json}");
            }
            assert_eq!(json["dtype"], "float32");
            let rope = &json["rope_parameters"];
            assert_eq!(rope["rope_type"], rope_type, "{preset:?}");
            assert_eq!(rope["rope_theta"], config.rope_theta, "{preset:?}");
        }
        assert_eq!(
            to_json(&Preset::Gpt2.config(1000)).unwrap()["dtype"],
            "float32"
        );
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
        let err = refusal(&published, |c| c["sliding_window"] = json!(4096));
        assert!(err.contains("field sliding_window = 4096"), "{err}");
        let err = refusal(&published, |c| {
            c["rope_scaling"]["rope_type"] = json!("yarn")
        });
        assert!(err.contains("rope_type = \"yarn\""), "{err}");

        // The same model as transformers 5 saves it: one rope_parameters object, `dtype`.
        let mut v5 = published;
        let map = v5.as_object_mut().unwrap();
        let mut rope = map.remove("rope_scaling").unwrap();
        rope["rope_theta"] = map.remove("rope_theta").unwrap();
        map.insert("rope_parameters".into(), rope);
        let dtype = map.remove("torch_dtype").unwrap();
        map.insert("dtype".into(), dtype);
        assert_eq!(
            from_json(&v5, 0.0).unwrap(),
            config,
            "transformers 5's form"
        );
    }

    /// Qwen2.5 0.5B's published config.json reads as Llama's block with biases on Q, K and V
    /// alone; written back, it is a Qwen2 config again (transformers 5's form) and reads the same.
    #[test]
    fn qwen2_config_reads_as_llama_with_qkv_biases() {
        let published = json!({
            "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
            "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
            "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
            "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
            "tie_word_embeddings": true, "torch_dtype": "bfloat16",
            "transformers_version": "4.40.1", "use_cache": true, "use_sliding_window": false,
            "vocab_size": 151936
        });
        let config = from_json(&published, 0.0).unwrap();
        let expected = GptConfig {
            kind: ModelKind::Llama,
            vocab_size: 151_936,
            n_layer: 24,
            n_head: 14,
            n_kv_head: 2,
            d_model: 896,
            head_dim: None,
            ffn_hidden: 4864,
            context: 32_768,
            dropout: 0.0,
            bias: false,
            qkv_bias: true,
            qk_norm: false,
            tie_embeddings: true,
            rope_theta: 1e6,
            rope_scaling: None,
            norm_eps: 1e-6,
            sliding_window: None,
        };
        assert_eq!(config, expected);
        // 494 M parameters, as Qwen2.5-0.5B's model card counts them.
        assert_eq!(config.parameter_count(), 494_032_768);
        assert_writes_back_as(&config, "qwen2");
        // Heads set apart from the width (as Qwen3's and Mistral-Nemo's are) round-trip too.
        let apart = GptConfig {
            head_dim: Some(128),
            ..config
        };
        assert_eq!(from_json(&to_json(&apart).unwrap(), 0.0).unwrap(), apart);
        let err = refusal(&published, |c| c["attention_bias"] = json!(true));
        assert!(
            err.contains("attention_bias = true is not qwen2's"),
            "{err}"
        );
    }

    /// Mistral 7B v0.1's published config.json reads as Llama's block with a sliding window of
    /// 4,096 keys (7.24 B parameters, as published), and is written back as a Mistral config; a
    /// window with biases belongs to no family and is refused on export.
    #[test]
    fn mistral_config_reads_as_llama_with_a_window() {
        let published = json!({
            "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
            "intermediate_size": 14336, "max_position_embeddings": 32768,
            "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
            "sliding_window": 4096, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "transformers_version": "4.34.0.dev0", "use_cache": true, "vocab_size": 32000
        });
        let config = from_json(&published, 0.0).unwrap();
        assert_eq!(config.sliding_window, Some(4096));
        assert_eq!(
            (config.n_head, config.n_kv_head, config.qkv_bias),
            (32, 8, false)
        );
        assert_eq!(config.parameter_count(), 7_241_732_096);
        assert_writes_back_as(&config, "mistral");
        let biased = GptConfig {
            qkv_bias: true,
            ..config
        };
        let err = to_json(&biased).unwrap_err().to_string();
        assert!(
            err.contains("model.sliding_window = 4096 with model.qkv_bias = true"),
            "{err}"
        );
        let err = refusal(&published, |c| c["use_sliding_window"] = json!(true));
        assert!(
            err.contains("use_sliding_window = true is not Mistral's"),
            "{err}"
        );
    }

    /// Qwen3 0.6B's published config.json reads as Llama's block with heads set apart from the
    /// width (16 of 128 on 1,024) and an RMSNorm of each head of Q and K: 0.44 B parameters
    /// outside the embedding, as published; written back, a Qwen3 config again.
    #[test]
    fn qwen3_config_reads_as_llama_with_qk_norms() {
        let published = json!({
            "architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
            "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
            "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
            "initializer_range": 0.02, "intermediate_size": 3072,
            "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
            "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
            "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
            "vocab_size": 151936
        });
        let config = from_json(&published, 0.0).unwrap();
        assert!(config.qk_norm && !config.qkv_bias && !config.bias);
        assert_eq!((config.head_dim, config.q_width()), (Some(128), 2048));
        let embedding = config.vocab_size * config.d_model;
        assert_eq!(config.parameter_count() - embedding, 440_467_456);
        assert_writes_back_as(&config, "qwen3");
        let err = refusal(&published, |c| c["attention_bias"] = json!(true));
        assert!(
            err.contains("attention_bias = true is not supported"),
            "{err}"
        );
    }

    /// A small Llama as transformers 5 writes it, with the fields that change nothing here.
    fn llama_v5() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float32",
            "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "tie_word_embeddings": false, "transformers_version": "5.0.0"
        })
    }

    /// RoPE in transformers 5's form, whatever else a config carries that changes nothing: a
    /// sliding window switched off (Qwen2's configs), every layer's type the full attention.
    #[test]
    fn rope_parameters_and_inert_fields_are_read() {
        let config = from_json(&llama_v5(), 0.0).unwrap();
        assert_eq!((config.rope_theta, config.rope_scaling), (10_000.0, None));
        let mut json = llama_v5();
        json["rope_parameters"] = json!({"rope_theta": 500000.0, "partial_rotary_factor": 1.0});
        json["use_sliding_window"] = json!(false);
        json["sliding_window"] = json!(4096);
        json["max_window_layers"] = json!(28);
        json["layer_types"] = json!(["full_attention", "full_attention"]);
        json["rope_theta"] = json!(500000.0);
        let config = from_json(&json, 0.0).unwrap();
        assert_eq!((config.rope_theta, config.rope_scaling), (500_000.0, None));
        let mut json = llama_v5();
        json["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0,
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192});
        let scaling = from_json(&json, 0.0).unwrap().rope_scaling;
        assert_eq!(scaling, Some(Llama3Scaling::llama3(8.0)));
    }

    /// What would change the computation is refused, naming the field and its value.
    #[test]
    fn rope_and_attention_settings_beyond_the_model_are_named() {
        let cases: [(&str, Value, &str); 7] = [
            (
                "rope_parameters",
                json!({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
                "rope_parameters.rope_type = \"yarn\" is not supported (default and llama3 are)",
            ),
            (
                "rope_parameters",
                json!({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
                "rope_parameters.partial_rotary_factor = 0.5 is not supported",
            ),
            (
                "rope_scaling",
                json!({"rope_type": "llama3", "factor": 8.0}),
                "both rope_parameters = ",
            ),
            (
                "rope_theta",
                json!(500000.0),
                "rope_theta = 500000 but rope_parameters.rope_theta = 10000",
            ),
            (
                "layer_types",
                json!(["full_attention", "sliding_attention"]),
                "layer_types = [\"full_attention\",\"sliding_attention\"] is not supported",
            ),
            (
                "sliding_window",
                json!(4096),
                "field sliding_window = 4096 is not supported",
            ),
            (
                "use_sliding_window",
                json!(true),
                "use_sliding_window = true is not supported",
            ),
        ];
        for (key, value, expected) in cases {
            let mut json = llama_v5();
            json[key] = value;
            let err = from_json(&json, 0.0).unwrap_err().to_string();
            assert!(err.contains(expected), "{key}: {err}");
        }
    }
}
