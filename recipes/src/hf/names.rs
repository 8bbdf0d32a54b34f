//! Our parameter names against Hugging Face's, per model kind, and which tensors PyTorch stores
//! transposed.
//!
//! GPT-2 (`GPT2LMHeadModel`) uses GPT-2's own module names, so the mapping is a rename:
//! `embeddings.wte|wpe.*` ↔ `wte|wpe.*`, `blocks.{i}.*` ↔ `h.{i}.*`, `head.ln_f.*` ↔ `ln_f.*`,
//! LayerNorm `gamma`/`beta` ↔ `weight`/`bias`. GPT-2's Conv1D stores weights `[in, out]` as
//! Burn's `Linear` does: no transpose, and the fused `c_attn` keeps its `[q | k | v]` columns.
//! Only an untied `lm_head` (an `nn.Linear`, `[out, in]`) is transposed.
//!
//! Llama (`LlamaForCausalLM`): `embeddings.wte` ↔ `model.embed_tokens`, `blocks.{i}` ↔
//! `model.layers.{i}`, `ln_1`/`ln_2` ↔ `input_layernorm`/`post_attention_layernorm`,
//! `attn.{q,k,v}_proj` ↔ `self_attn.{q,k,v}_proj`, `attn.c_proj` ↔ `self_attn.o_proj`,
//! `mlp.gate|c_fc|c_proj` ↔ `mlp.gate_proj|up_proj|down_proj`, `head.ln_f` ↔ `model.norm`,
//! `head.lm_head` ↔ `lm_head`; Qwen3's `attn.q_norm|k_norm.gamma` ↔ `self_attn.q_norm|k_norm.weight`
//! by the same pieces. Every projection is an `nn.Linear`, so every matrix but the
//! embedding is transposed. Hugging Face's Llama checkpoints hold Q and K with each head's
//! rotary pairs as halves (`(i, i + d/2)`: the conversion from Meta's interleaved pairs permuted
//! their rows), which is the layout our rotary embedding uses: no permutation either way.

use crate::model::ModelKind;

/// Our parameter name → Hugging Face's, for a model of `kind`.
pub fn hf_name(kind: ModelKind, ours: &str) -> String {
    match kind {
        ModelKind::Gpt => gpt2_name(ours),
        ModelKind::Llama => llama_name(ours),
    }
}

fn gpt2_name(ours: &str) -> String {
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

/// Our module paths' pieces and Llama's, in the order they are tried.
const LLAMA_PIECES: [(&str, &str); 12] = [
    ("embeddings.wte.", "model.embed_tokens."),
    ("blocks.", "model.layers."),
    ("head.ln_f.", "model.norm."),
    ("head.lm_head.", "lm_head."),
    (".ln_1.", ".input_layernorm."),
    (".ln_2.", ".post_attention_layernorm."),
    (".attn.c_proj.", ".self_attn.o_proj."),
    (".attn.", ".self_attn."),
    (".mlp.gate.", ".mlp.gate_proj."),
    (".mlp.c_fc.", ".mlp.up_proj."),
    (".mlp.c_proj.", ".mlp.down_proj."),
    (".gamma", ".weight"),
];

fn llama_name(ours: &str) -> String {
    let mut name = ours.to_string();
    for (from, to) in LLAMA_PIECES {
        // Each piece occurs at most once in a name, and no replacement makes another match.
        if let Some(at) = name.find(from) {
            name.replace_range(at..at + from.len(), to);
        }
    }
    name
}

/// Whether Hugging Face stores the tensor `hf` (a name from [`hf_name`]) as the transpose of
/// ours: PyTorch's `nn.Linear` weights are `[out, in]`.
pub fn is_transposed(kind: ModelKind, hf: &str) -> bool {
    match kind {
        ModelKind::Gpt => hf == "lm_head.weight",
        ModelKind::Llama => hf == "lm_head.weight" || hf.ends_with("_proj.weight"),
    }
}

/// Tensors of Hugging Face files that hold no parameter of ours: GPT-2's attention mask
/// buffers, Llama's cached rotary frequencies, and the head of a tied model (the embedding).
pub fn is_ignored(hf: &str, tied: bool) -> bool {
    hf.ends_with(".attn.bias")
        || hf.ends_with(".attn.masked_bias")
        || hf.ends_with(".rotary_emb.inv_freq")
        || (tied && hf == "lm_head.weight")
}

/// The name without the prefix some files put before GPT-2's names.
pub fn without_prefix(kind: ModelKind, key: &str) -> &str {
    match kind {
        ModelKind::Gpt => key.strip_prefix("transformer.").unwrap_or(key),
        ModelKind::Llama => key,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_names_are_hugging_faces() {
        for (ours, theirs) in [
            ("embeddings.wte.weight", "model.embed_tokens.weight"),
            (
                "blocks.3.ln_1.gamma",
                "model.layers.3.input_layernorm.weight",
            ),
            (
                "blocks.3.ln_2.gamma",
                "model.layers.3.post_attention_layernorm.weight",
            ),
            (
                "blocks.0.attn.q_proj.weight",
                "model.layers.0.self_attn.q_proj.weight",
            ),
            (
                "blocks.0.attn.k_proj.bias",
                "model.layers.0.self_attn.k_proj.bias",
            ),
            (
                "blocks.0.attn.c_proj.weight",
                "model.layers.0.self_attn.o_proj.weight",
            ),
            (
                "blocks.1.mlp.gate.weight",
                "model.layers.1.mlp.gate_proj.weight",
            ),
            (
                "blocks.1.mlp.c_fc.weight",
                "model.layers.1.mlp.up_proj.weight",
            ),
            (
                "blocks.1.mlp.c_proj.weight",
                "model.layers.1.mlp.down_proj.weight",
            ),
            ("head.ln_f.gamma", "model.norm.weight"),
            ("head.lm_head.weight", "lm_head.weight"),
        ] {
            assert_eq!(hf_name(ModelKind::Llama, ours), theirs);
        }
        assert!(is_transposed(
            ModelKind::Llama,
            "model.layers.0.mlp.up_proj.weight"
        ));
        assert!(!is_transposed(
            ModelKind::Llama,
            "model.embed_tokens.weight"
        ));
        assert!(!is_transposed(
            ModelKind::Llama,
            "model.layers.0.self_attn.q_proj.bias"
        ));
    }

    #[test]
    fn gpt2_names_are_hugging_faces() {
        assert_eq!(
            hf_name(ModelKind::Gpt, "blocks.2.ln_1.beta"),
            "h.2.ln_1.bias"
        );
        assert_eq!(
            hf_name(ModelKind::Gpt, "embeddings.wpe.weight"),
            "wpe.weight"
        );
        assert_eq!(hf_name(ModelKind::Gpt, "head.ln_f.gamma"), "ln_f.weight");
    }
}
