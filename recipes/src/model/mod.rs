//! The recipe's decoder-only transformer: its configuration (with presets), the modules, and the
//! numbers derived from a configuration (parameter count, FLOPs per token).
//!
//! One model type covers both families the recipe trains, chosen by [`ModelKind`] (as
//! Megatron-LM's GPT model covers Llama by switches): GPT-2 (LayerNorm, learned positions, GELU
//! MLP, one fused QKV projection) and Llama (RMSNorm, rotary positions, SwiGLU MLP,
//! grouped-query attention with separate Q, K and V projections, no biases).
//!
//! The model is written for the parallel layouts that follow it:
//! - blocks carry their *global* index, so a pipeline stage holding blocks 4..8 names them
//!   `blocks.4` … `blocks.7` in checkpoints ([`StageSpec`]);
//! - the embeddings and the head are optional per stage;
//! - every linear layer is built whole by one function (`gpt::linear`), as wildfire's
//!   `ParallelLinear`; under tensor parallelism `wildfire_parallel::tp::apply_plan` splits the
//!   layers the plan [`TP_PLAN`] names (by parameter path) into this rank's parts.

mod chunks;
mod gpt;
mod kv_cache;
pub mod params;
pub mod rope;

pub use chunks::{GptChunks, stage_specs};
pub use gpt::{
    Block, CausalSelfAttention, Embeddings, Gpt, Head, Mlp, Norm, SEQUENCE_DIM, TIED_COPY,
    TOKEN_EMBEDDING, TP_PLAN, causal_attention, cross_entropy_sum, gated_silu, gelu_tanh, tp_rules,
    whole_model_rules,
};
pub use kv_cache::KvCache;

use serde::{Deserialize, Serialize};

pub use rope::Llama3Scaling;

/// The architecture family: which norm, position encoding, MLP and attention the blocks use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelKind {
    /// GPT-2: LayerNorm, learned position embedding, GELU(tanh) MLP, fused QKV projection.
    #[default]
    Gpt,
    /// Llama: RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query attention.
    Llama,
}

impl std::fmt::Display for ModelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ModelKind::Gpt => "gpt",
            ModelKind::Llama => "llama",
        })
    }
}

/// Sizes and switches of the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "StoredConfig")]
pub struct GptConfig {
    /// The architecture family.
    pub kind: ModelKind,
    /// Tokens in the vocabulary (rows of the token embedding).
    pub vocab_size: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block; `d_model % n_head == 0` unless `head_dim` is given.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention, Llama): each serves `n_head / n_kv_head` query
    /// heads. `n_head` for GPT.
    pub n_kv_head: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Width of one attention head where it is not `d_model / n_head` (Llama only: Qwen3 and
    /// Mistral-Nemo set it apart); `None` where it is. See [`GptConfig::head_dim`].
    pub head_dim: Option<usize>,
    /// Width of the MLP's hidden layer: 4·d_model for GPT-2, SwiGLU's width for Llama.
    pub ffn_hidden: usize,
    /// Longest sequence the model takes (the position embedding's rows; the RoPE tables).
    pub context: usize,
    /// Dropout probability on embeddings, attention weights and residual branches.
    pub dropout: f64,
    /// Biases in linear layers and LayerNorms (GPT-2 has them).
    pub bias: bool,
    /// Biases on the query, key and value projections alone (Qwen2; Llama only): not on the
    /// output projection or the MLP. `bias` puts them everywhere.
    pub qkv_bias: bool,
    /// An RMSNorm of each head of Q and of K, before the rotation (Qwen3; Llama only): one
    /// `head_dim`-wide γ for Q's heads and one for K's.
    pub qk_norm: bool,
    /// The LM head reuses the token embedding matrix (GPT-2 does).
    pub tie_embeddings: bool,
    /// RoPE's base θ (Llama).
    pub rope_theta: f64,
    /// Llama 3.1's long-context frequency scaling (Llama), if any.
    pub rope_scaling: Option<Llama3Scaling>,
    /// The norms' ε (added to the variance, or to the mean square).
    pub norm_eps: f64,
    /// Mistral's sliding window (Llama only): a query at position i attends to the keys at
    /// positions i − w < j ≤ i, `w` of them at most; `None` attends to every earlier one.
    pub sliding_window: Option<usize>,
}

/// A [`GptConfig`] as checkpoints store it: those written before the Llama kind existed lack
/// its fields, and read as the GPT-2 they describe.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StoredConfig {
    #[serde(default)]
    kind: ModelKind,
    vocab_size: usize,
    n_layer: usize,
    n_head: usize,
    n_kv_head: Option<usize>,
    d_model: usize,
    #[serde(default)]
    head_dim: Option<usize>,
    ffn_hidden: Option<usize>,
    context: usize,
    dropout: f64,
    bias: bool,
    #[serde(default)]
    qkv_bias: bool,
    #[serde(default)]
    qk_norm: bool,
    tie_embeddings: bool,
    rope_theta: Option<f64>,
    rope_scaling: Option<Llama3Scaling>,
    norm_eps: Option<f64>,
    #[serde(default)]
    sliding_window: Option<usize>,
}

impl From<StoredConfig> for GptConfig {
    fn from(stored: StoredConfig) -> Self {
        Self {
            kind: stored.kind,
            vocab_size: stored.vocab_size,
            n_layer: stored.n_layer,
            n_head: stored.n_head,
            n_kv_head: stored.n_kv_head.unwrap_or(stored.n_head),
            d_model: stored.d_model,
            head_dim: stored.head_dim,
            ffn_hidden: stored.ffn_hidden.unwrap_or(4 * stored.d_model),
            context: stored.context,
            dropout: stored.dropout,
            bias: stored.bias,
            qkv_bias: stored.qkv_bias,
            qk_norm: stored.qk_norm,
            tie_embeddings: stored.tie_embeddings,
            rope_theta: stored.rope_theta.unwrap_or(10_000.0),
            rope_scaling: stored.rope_scaling,
            norm_eps: stored.norm_eps.unwrap_or(1e-5),
            sliding_window: stored.sliding_window,
        }
    }
}

/// A named size. `tiny` and `llama-tiny` are CPU-sized; the others are GPT-2's and Llama 3's
/// published shapes (the vocabulary is the tokenizer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Preset {
    /// GPT: 4 layers, 4 heads, 128 wide, context 128.
    Tiny,
    /// GPT-2 small, 124M parameters.
    Gpt2,
    /// GPT-2 medium, 350M parameters.
    Gpt2Medium,
    /// Llama: 4 layers, 4 heads sharing 2 key/value heads, 128 wide, SwiGLU 384 wide (the
    /// block has the tiny GPT's 12·d² weights), context 128, untied head.
    LlamaTiny,
    /// Llama 3.2 1B: 16 layers, 32 heads, 8 key/value heads, 2048 wide, tied head, θ = 500,000,
    /// llama3 scaling with factor 32; 1.24B parameters with Llama 3's 128,256 tokens.
    Llama1b,
    /// Llama 3.1 8B: 32 layers, 32 heads, 8 key/value heads, 4096 wide, untied head,
    /// θ = 500,000, llama3 scaling with factor 8; 8.03B parameters with 128,256 tokens.
    Llama8b,
}

impl Preset {
    /// The preset's sizes for a vocabulary of `vocab_size` tokens.
    pub fn config(self, vocab_size: usize) -> GptConfig {
        let gpt = |n_layer, n_head, d_model: usize, context| GptConfig {
            kind: ModelKind::Gpt,
            vocab_size,
            n_layer,
            n_head,
            n_kv_head: n_head,
            d_model,
            head_dim: None,
            ffn_hidden: 4 * d_model,
            context,
            dropout: 0.0,
            bias: true,
            qkv_bias: false,
            qk_norm: false,
            tie_embeddings: true,
            rope_theta: 10_000.0,
            rope_scaling: None,
            norm_eps: 1e-5,
            sliding_window: None,
        };
        let llama = |n_layer, (n_head, n_kv_head), d_model, ffn_hidden, context| GptConfig {
            kind: ModelKind::Llama,
            n_kv_head,
            ffn_hidden,
            bias: false,
            tie_embeddings: false,
            ..gpt(n_layer, n_head, d_model, context)
        };
        match self {
            Preset::Tiny => gpt(4, 4, 128, 128),
            Preset::Gpt2 => gpt(12, 12, 768, 1024),
            Preset::Gpt2Medium => gpt(24, 16, 1024, 1024),
            Preset::LlamaTiny => llama(4, (4, 2), 128, 384, 128),
            Preset::Llama1b => GptConfig {
                tie_embeddings: true,
                rope_theta: 500_000.0,
                rope_scaling: Some(Llama3Scaling::llama3(32.0)),
                ..llama(16, (32, 8), 2048, 8192, 8192)
            },
            Preset::Llama8b => GptConfig {
                rope_theta: 500_000.0,
                rope_scaling: Some(Llama3Scaling::llama3(8.0)),
                ..llama(32, (32, 8), 4096, 14336, 8192)
            },
        }
    }
}

/// A configuration that cannot build a model, with the numbers that make it so.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("model.d_model = {d_model} is not divisible by model.n_head = {n_head}")]
    HeadsDoNotDivide { d_model: usize, n_head: usize },
    #[error("model.{field} must be at least 1, got 0")]
    Zero { field: &'static str },
    #[error("model.dropout = {0} is outside [0, 1)")]
    Dropout(f64),
    #[error("model.n_head = {n_head} is not divisible by model.n_kv_head = {n_kv_head}")]
    KvHeadsDoNotDivide { n_head: usize, n_kv_head: usize },
    #[error(
        "model.n_kv_head = {n_kv_head} differs from model.n_head = {n_head}: grouped-query \
         attention needs model.kind = \"llama\""
    )]
    GroupedQueryInGpt { n_head: usize, n_kv_head: usize },
    #[error("rotary embeddings need an even head width, and the head width is {0}")]
    OddHeadWidth(usize),
    #[error(
        "model.{field} needs model.kind = \"llama\" (GPT-2's fused QKV projection has neither)"
    )]
    LlamaOnly { field: &'static str },
    #[error("model.rope_theta = {0} must be above 1")]
    RopeTheta(f64),
    #[error("{0}")]
    RopeScaling(String),
    #[error("model.norm_eps = {0} must be positive")]
    NormEps(f64),
}

impl GptConfig {
    /// Checks the sizes; every model built from this config can assume them.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("vocab_size", self.vocab_size),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_kv_head", self.n_kv_head),
            ("d_model", self.d_model),
            ("ffn_hidden", self.ffn_hidden),
            ("context", self.context),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        for (field, value) in [
            ("head_dim", self.head_dim),
            ("sliding_window", self.sliding_window),
        ] {
            if value == Some(0) {
                return Err(ConfigError::Zero { field });
            }
        }
        if self.kind == ModelKind::Gpt {
            for (field, set) in [
                ("head_dim", self.head_dim.is_some()),
                ("qkv_bias", self.qkv_bias),
                ("qk_norm", self.qk_norm),
                ("sliding_window", self.sliding_window.is_some()),
            ] {
                if set {
                    return Err(ConfigError::LlamaOnly { field });
                }
            }
        }
        if self.head_dim.is_none() && !self.d_model.is_multiple_of(self.n_head) {
            return Err(ConfigError::HeadsDoNotDivide {
                d_model: self.d_model,
                n_head: self.n_head,
            });
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ConfigError::Dropout(self.dropout));
        }
        let (n_head, n_kv_head) = (self.n_head, self.n_kv_head);
        if !n_head.is_multiple_of(n_kv_head) {
            return Err(ConfigError::KvHeadsDoNotDivide { n_head, n_kv_head });
        }
        if self.kind == ModelKind::Gpt && n_kv_head != n_head {
            return Err(ConfigError::GroupedQueryInGpt { n_head, n_kv_head });
        }
        if self.norm_eps.is_nan() || self.norm_eps <= 0.0 {
            return Err(ConfigError::NormEps(self.norm_eps));
        }
        if self.kind == ModelKind::Llama {
            if !self.head_dim().is_multiple_of(2) {
                return Err(ConfigError::OddHeadWidth(self.head_dim()));
            }
            if self.rope_theta.is_nan() || self.rope_theta <= 1.0 {
                return Err(ConfigError::RopeTheta(self.rope_theta));
            }
            if let Some(scaling) = &self.rope_scaling {
                scaling.validate().map_err(ConfigError::RopeScaling)?;
            }
        }
        Ok(())
    }

    /// Width of one attention head: `head_dim` where given, else `d_model / n_head`.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_head)
    }

    /// `head_dim` as this config stores it: `None` where it is `d_model / n_head` anyway, so
    /// one model has one config however its sizes were written.
    pub fn explicit_head_dim(d_model: usize, n_head: usize, head_dim: usize) -> Option<usize> {
        (n_head == 0 || head_dim * n_head != d_model).then_some(head_dim)
    }

    /// Width of the query projection and the output projection's input: `n_head · head_dim`
    /// (d unless `head_dim` sets the heads apart).
    pub fn q_width(&self) -> usize {
        self.n_head * self.head_dim()
    }

    /// Width of the key and value projections: `n_kv_head · head_dim` (d without grouping).
    pub fn kv_width(&self) -> usize {
        self.n_kv_head * self.head_dim()
    }

    /// Parameters of the whole model, counting a tied embedding once.
    ///
    /// Per block, with `d_q` = [`Self::q_width`], `d_kv` = [`Self::kv_width`] and `f` =
    /// `ffn_hidden`: Q and output projections 2·d·d_q, K and V 2·d·d_kv, the MLP 2·d·f (GPT) or
    /// 3·d·f (SwiGLU's gate, up and down), and with biases their d_q + 2·d_kv + d and f + d
    /// (2f + d gated) entries (with `qkv_bias`, d_q + 2·d_kv); two norms of 2d (LayerNorm with a
    /// bias) or d, and with `qk_norm` two of `head_dim`. GPT-2 (d_q = d_kv = d, f = 4d) has 12d²
    /// weights per block.
    /// Plus the token embedding V·d, GPT's position embedding T·d, the final norm and, untied,
    /// the head V·d.
    pub fn parameter_count(&self) -> usize {
        let (d, d_q, d_kv, f) = (
            self.d_model,
            self.q_width(),
            self.kv_width(),
            self.ffn_hidden,
        );
        let gated = self.kind == ModelKind::Llama;
        let norm = if self.bias && !gated { 2 * d } else { d };
        let (mlp_matrices, mlp_biases) = if gated { (3, 2 * f + d) } else { (2, f + d) };
        let linear_biases = match (self.bias, self.qkv_bias) {
            (true, _) => d_q + 2 * d_kv + d + mlp_biases,
            (false, true) => d_q + 2 * d_kv,
            (false, false) => 0,
        };
        let qk_norms = if self.qk_norm { 2 * self.head_dim() } else { 0 };
        let block =
            2 * d * d_q + 2 * d * d_kv + mlp_matrices * d * f + linear_biases + 2 * norm + qk_norms;
        let head = if self.tie_embeddings {
            0
        } else {
            self.vocab_size * d
        };
        self.n_layer * block + self.vocab_size * d + self.position_rows() * d + norm + head
    }

    /// Rows of the learned position embedding: `context` for GPT, none for Llama (rotary).
    pub fn position_rows(&self) -> usize {
        match self.kind {
            ModelKind::Gpt => self.context,
            ModelKind::Llama => 0,
        }
    }

    /// Training FLOPs per token at sequence length `seq`: 6N + 12·L·H·d_head·T.
    ///
    /// 6N counts the forward (2 FLOPs per weight per token) and the backward (4) of every matmul
    /// weight. N excludes the lookups: the position embedding, and the token embedding when an
    /// untied head has its own matrix (a tied one is the head's matmul). The second term is
    /// attention's QKᵀ and AV products, forward and backward, which N does not see.
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let lookups = self.position_rows()
            + if self.tie_embeddings {
                0
            } else {
                self.vocab_size
            };
        let n = (self.parameter_count() - lookups * self.d_model) as f64;
        let attention = 12 * self.n_layer * self.n_head * self.head_dim() * seq;
        6.0 * n + attention as f64
    }
}

/// Which part of the model one pipeline stage holds. A single device holds everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageSpec {
    /// Global index of the stage's first block.
    pub first_block: usize,
    /// Number of consecutive blocks on the stage.
    pub n_blocks: usize,
    /// The stage embeds tokens (the first stage).
    pub embedding: bool,
    /// The stage applies the final LayerNorm and the LM head (the last stage).
    pub head: bool,
}

impl StageSpec {
    /// The whole model on one stage.
    pub fn whole(config: &GptConfig) -> Self {
        Self {
            first_block: 0,
            n_blocks: config.n_layer,
            embedding: true,
            head: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::module::Module;
    use burn::tensor::backend::Backend;
    use burn::tensor::{Int, Tensor};

    use super::*;
    use crate::CpuBackend;

    #[test]
    fn parameter_counts_match_gpt2() {
        assert_eq!(Preset::Gpt2.config(50257).parameter_count(), 124_439_808);
        assert_eq!(
            Preset::Gpt2Medium.config(50257).parameter_count(),
            354_823_168
        );
        let config = Preset::Tiny.config(65);
        let model = Gpt::<Flex>::new(&config, StageSpec::whole(&config), &Default::default());
        assert_eq!(model.num_params(), config.parameter_count());
        let untied = GptConfig {
            tie_embeddings: false,
            bias: false,
            ..config
        };
        let model = Gpt::<Flex>::new(&untied, StageSpec::whole(&untied), &Default::default());
        assert_eq!(model.num_params(), untied.parameter_count());
    }

    #[test]
    fn stages_name_blocks_by_global_index() {
        let config = Preset::Tiny.config(65);
        let stage = StageSpec {
            first_block: 2,
            n_blocks: 2,
            embedding: false,
            head: true,
        };
        let model = Gpt::<Flex>::new(&config, stage, &Default::default());
        let names: Vec<String> = params::collect_params(&model, model.first_block)
            .into_iter()
            .map(|(n, _, _)| n)
            .collect();
        assert!(
            names.contains(&"blocks.2.attn.c_attn.weight".to_string()),
            "{names:?}"
        );
        assert!(
            names.contains(&"blocks.3.mlp.c_proj.bias".to_string()),
            "{names:?}"
        );
        assert!(names.contains(&"head.ln_f.gamma".to_string()), "{names:?}");
        assert!(
            !names
                .iter()
                .any(|n| n.starts_with("blocks.0") || n.starts_with("embeddings"))
        );
    }

    /// GPT-2's initialisation gives near-uniform predictions: loss ≈ ln(V).
    #[test]
    fn initial_loss_is_about_ln_vocab() {
        let config = Preset::Tiny.config(65);
        let device = Default::default();
        CpuBackend::seed(&device, 3);
        let model = Gpt::<CpuBackend>::new(&config, StageSpec::whole(&config), &device);
        let tokens = Tensor::<CpuBackend, 1, Int>::arange(0..256, &device)
            .remainder_scalar(65)
            .reshape([2, 128]);
        // Targets differ from inputs: with a tied head, a token's own embedding scores high.
        let targets = tokens.clone().add_scalar(1).remainder_scalar(65);
        let (loss, count) = cross_entropy_sum(model.forward(tokens), targets);
        let mean = loss.into_scalar() / count as f32;
        assert!(
            (mean - 65f32.ln()).abs() < 0.1,
            "initial loss {mean}, ln 65 = {}",
            65f32.ln()
        );
    }

    /// A model stored before the Llama kind (no kind, heads, widths or RoPE fields) reads as
    /// the GPT-2 it is; every field round-trips.
    #[test]
    fn stored_configs_of_either_age_read_back() {
        let old = r#"{"vocab_size": 65, "n_layer": 4, "n_head": 4, "d_model": 128,
            "context": 128, "dropout": 0.0, "bias": true, "tie_embeddings": true}"#;
        let config: GptConfig = serde_json::from_str(old).unwrap();
        assert_eq!(config, Preset::Tiny.config(65));
        for preset in [Preset::Tiny, Preset::Llama1b] {
            let config = preset.config(100);
            let json = serde_json::to_string(&config).unwrap();
            assert_eq!(serde_json::from_str::<GptConfig>(&json).unwrap(), config);
        }
    }

    /// Heads set apart from the width and biases on Q, K and V alone build the parameters that
    /// `parameter_count` counts; both are refused on GPT's fused QKV projection.
    #[test]
    fn llama_heads_apart_and_qkv_biases_count_their_parameters() {
        let config = GptConfig {
            head_dim: Some(48),
            qkv_bias: true,
            ..Preset::LlamaTiny.config(65)
        };
        assert_eq!((config.q_width(), config.kv_width()), (192, 96));
        let model = Gpt::<Flex>::new(&config, StageSpec::whole(&config), &Default::default());
        assert_eq!(model.num_params(), config.parameter_count());
        let names: Vec<String> = params::collect_params(&model, 0)
            .into_iter()
            .map(|(n, _, _)| n)
            .collect();
        for bias in ["q_proj", "k_proj", "v_proj"] {
            assert!(
                names.contains(&format!("blocks.0.attn.{bias}.bias")),
                "{names:?}"
            );
        }
        assert!(
            !names.iter().any(|n| n.contains("c_proj.bias")),
            "{names:?}"
        );
        for (config, field) in [
            (
                GptConfig {
                    head_dim: Some(16),
                    ..Preset::Tiny.config(65)
                },
                "head_dim",
            ),
            (
                GptConfig {
                    qkv_bias: true,
                    ..Preset::Tiny.config(65)
                },
                "qkv_bias",
            ),
        ] {
            assert_eq!(config.validate(), Err(ConfigError::LlamaOnly { field }));
        }
    }

    /// A sliding window of `w` hides later keys and those `w` or more positions back; one as
    /// long as the sequence hides what causality hides, so the model computes the same bits.
    #[test]
    fn a_sliding_window_hides_the_keys_it_slides_past() {
        use super::gpt::is_hidden;
        let seen = |query: usize, window| -> Vec<usize> {
            (0..8)
                .filter(|&key| !is_hidden(query, key, window))
                .collect()
        };
        assert_eq!(seen(5, None), [0, 1, 2, 3, 4, 5]);
        assert_eq!(seen(5, Some(3)), [3, 4, 5]);
        assert_eq!(seen(1, Some(3)), [0, 1]);
        let config = Preset::LlamaTiny.config(65);
        let device = Default::default();
        let tokens = Tensor::<CpuBackend, 1, Int>::arange(0..32, &device)
            .remainder_scalar(65)
            .reshape([2, 16]);
        // The same draw and the same decomposed ops each time (a windowed model runs no fused
        // attention): only the window differs.
        let logits_with = |window: Option<usize>| -> Vec<f32> {
            let config = GptConfig {
                sliding_window: window,
                ..config.clone()
            };
            CpuBackend::seed(&device, 5);
            let model = Gpt::<CpuBackend>::new(&config, StageSpec::whole(&config), &device)
                .with_fused_ops(wildfire_backend::kernels::choice::FusedOps::all(false));
            model.forward(tokens.clone()).into_data().to_vec().unwrap()
        };
        let full = logits_with(None);
        assert_eq!(
            full,
            logits_with(Some(16)),
            "a window as long as the sequence"
        );
        assert_ne!(
            full,
            logits_with(Some(4)),
            "a window of 4 in a sequence of 16"
        );
    }

    #[test]
    fn bad_sizes_name_the_numbers() {
        let config = GptConfig {
            n_head: 3,
            ..Preset::Tiny.config(65)
        };
        assert_eq!(
            config.validate().unwrap_err().to_string(),
            "model.d_model = 128 is not divisible by model.n_head = 3"
        );
    }
}
