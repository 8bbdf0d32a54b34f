//! The GPT-2 model: its configuration (with presets), the modules, and the numbers derived from
//! a configuration (parameter count, FLOPs per token).
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
pub mod params;

pub use chunks::{GptChunks, stage_specs};
pub use gpt::{
    Block, CausalSelfAttention, Embeddings, Gpt, Head, Mlp, SEQUENCE_DIM, TIED_COPY,
    TOKEN_EMBEDDING, TP_PLAN, causal_attention, cross_entropy_sum, gelu_tanh, whole_model_rules,
};

use serde::{Deserialize, Serialize};

/// Sizes and switches of a GPT-2 style model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GptConfig {
    /// Tokens in the vocabulary (rows of the token embedding).
    pub vocab_size: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block; `d_model % n_head == 0`.
    pub n_head: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Longest sequence the position embedding covers.
    pub context: usize,
    /// Dropout probability on embeddings, attention weights and residual branches.
    pub dropout: f64,
    /// Biases in linear layers and LayerNorms (GPT-2 has them).
    pub bias: bool,
    /// The LM head reuses the token embedding matrix (GPT-2 does).
    pub tie_embeddings: bool,
}

/// A named size. `tiny` is the CPU recipe's model; the others are GPT-2's published sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Preset {
    /// 4 layers, 4 heads, 128 wide, context 128.
    Tiny,
    /// GPT-2 small, 124M parameters.
    Gpt2,
    /// GPT-2 medium, 350M parameters.
    Gpt2Medium,
}

impl Preset {
    /// The preset's sizes for a vocabulary of `vocab_size` tokens.
    pub fn config(self, vocab_size: usize) -> GptConfig {
        let (n_layer, n_head, d_model, context) = match self {
            Preset::Tiny => (4, 4, 128, 128),
            Preset::Gpt2 => (12, 12, 768, 1024),
            Preset::Gpt2Medium => (24, 16, 1024, 1024),
        };
        GptConfig {
            vocab_size,
            n_layer,
            n_head,
            d_model,
            context,
            dropout: 0.0,
            bias: true,
            tie_embeddings: true,
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
}

impl GptConfig {
    /// Checks the sizes; every model built from this config can assume them.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("vocab_size", self.vocab_size),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("d_model", self.d_model),
            ("context", self.context),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero { field });
            }
        }
        if !self.d_model.is_multiple_of(self.n_head) {
            return Err(ConfigError::HeadsDoNotDivide {
                d_model: self.d_model,
                n_head: self.n_head,
            });
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ConfigError::Dropout(self.dropout));
        }
        Ok(())
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_head
    }

    /// Parameters of the whole model, counting a tied embedding once.
    ///
    /// Per block: LayerNorms 2·2d, QKV d·3d (+3d), output d·d (+d), MLP d·4d (+4d) and 4d·d (+d),
    /// i.e. 12d² weights and 13d bias/norm entries with biases (2d without: the norms' gains). Plus embeddings
    /// V·d + T·d, the final LayerNorm 2d (d without bias) and, untied, the head V·d.
    pub fn parameter_count(&self) -> usize {
        let d = self.d_model;
        let norm = if self.bias { 2 * d } else { d };
        let linear_biases = if self.bias { 9 * d } else { 0 };
        let block = 12 * d * d + linear_biases + 2 * norm;
        let head = if self.tie_embeddings {
            0
        } else {
            self.vocab_size * d
        };
        self.n_layer * block + self.vocab_size * d + self.context * d + norm + head
    }

    /// Training FLOPs per token at sequence length `seq`: 6N + 12·L·H·d_head·T.
    ///
    /// 6N counts the forward (2 FLOPs per weight per token) and the backward (4) of every matmul
    /// weight. N excludes the lookups: the position embedding, and the token embedding when an
    /// untied head has its own matrix (a tied one is the head's matmul). The second term is
    /// attention's QKᵀ and AV products, forward and backward, which N does not see.
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let lookups = self.context
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
