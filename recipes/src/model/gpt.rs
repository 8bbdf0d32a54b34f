//! GPT-2 modules: embeddings, pre-LayerNorm blocks (causal self-attention with a fused QKV
//! projection, GELU(tanh) MLP of width 4d), final LayerNorm and LM head.
//!
//! Parameter names follow Hugging Face's GPT-2 (`wte`, `wpe`, `ln_1`, `attn.c_attn`, `mlp.c_fc`,
//! …) so that importing and exporting weights is a rename of the block prefix and of LayerNorm's
//! gamma/beta. Linear weights are stored `[in, out]` (Burn's row layout, like GPT-2's Conv1D).

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig,
    Linear, LinearConfig,
};
use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor};

use super::{GptConfig, StageSpec};

/// Standard deviation of GPT-2's initialisation.
const INIT_STD: f64 = 0.02;
/// LayerNorm epsilon of GPT-2.
const LN_EPS: f64 = 1e-5;

/// Token and learned position embeddings, `h₀ = dropout(wte[x] + wpe[0..T])`.
#[derive(Module, Debug)]
pub struct Embeddings<B: Backend> {
    pub wte: Embedding<B>,
    pub wpe: Embedding<B>,
    pub dropout: Dropout,
}

/// Causal multi-head self-attention: `softmax(QKᵀ/√d_head + M)V` per head, with M = −∞ above the
/// diagonal, then the output projection.
#[derive(Module, Debug)]
pub struct CausalSelfAttention<B: Backend> {
    /// Fused Q, K, V projection, `[d, 3d]`.
    pub c_attn: Linear<B>,
    /// Output projection, `[d, d]` (a residual projection: scaled initialisation).
    pub c_proj: Linear<B>,
    pub attn_dropout: Dropout,
    pub resid_dropout: Dropout,
    pub n_head: usize,
}

/// `c_proj(gelu_tanh(c_fc(x)))`, hidden width 4d.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    pub c_fc: Linear<B>,
    pub c_proj: Linear<B>,
    pub dropout: Dropout,
}

/// Pre-LayerNorm transformer block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub ln_1: LayerNorm<B>,
    pub attn: CausalSelfAttention<B>,
    pub ln_2: LayerNorm<B>,
    pub mlp: Mlp<B>,
}

/// Final LayerNorm and, when embeddings are untied, the LM head `[d, V]`.
#[derive(Module, Debug)]
pub struct Head<B: Backend> {
    pub ln_f: LayerNorm<B>,
    pub lm_head: Option<Linear<B>>,
    /// A tied head on another pipeline stage than the embedding: its own copy of `wte`
    /// (`[V, d]`, named [`TIED_COPY`]). Both copies start equal and receive the sum of their two
    /// gradients, so they stay equal; checkpoints store only `embeddings.wte.weight`.
    pub wte: Option<Param<Tensor<B, 2>>>,
}

/// Name of the head's copy of a tied token embedding (see [`Head::wte`]).
pub const TIED_COPY: &str = "head.wte";
/// Name of the token embedding, which the tied copy mirrors.
pub const TOKEN_EMBEDDING: &str = "embeddings.wte.weight";

/// A GPT, or the part of one that a pipeline stage holds.
#[derive(Module, Debug)]
pub struct Gpt<B: Backend> {
    pub embeddings: Option<Embeddings<B>>,
    /// Blocks `first_block .. first_block + blocks.len()` of the full model.
    pub blocks: Vec<Block<B>>,
    pub head: Option<Head<B>>,
    /// Global index of `blocks[0]`.
    pub first_block: usize,
}

/// A linear layer initialised as GPT-2 does: weights N(0, std²), biases zero. Every linear layer
/// of the model is built here, the one place a tensor-parallel plan (keyed by parameter path,
/// `blocks.3.attn.c_attn`) will substitute sharded layers.
fn linear<B: Backend>(
    [d_in, d_out]: [usize; 2],
    bias: bool,
    std: f64,
    device: &B::Device,
) -> Linear<B> {
    let mut layer = LinearConfig::new(d_in, d_out)
        .with_bias(bias)
        .with_initializer(Initializer::Normal { mean: 0.0, std })
        .init(device);
    layer.bias = layer.bias.map(|b| Param::from_tensor(b.val().zeros_like()));
    layer
}

/// Draws every lazily initialised parameter (Burn initialises a parameter on its first use) in
/// module order, so that a model depends only on the RNG state when it was built: not on which
/// parameters a pipeline stage happens to use first, nor on other RNG users in between.
struct DrawNow;

impl<B: Backend> ModuleVisitor<B> for DrawNow {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        param.val();
    }
}

fn layer_norm<B: Backend>(config: &GptConfig, device: &B::Device) -> LayerNorm<B> {
    LayerNormConfig::new(config.d_model)
        .with_epsilon(LN_EPS)
        .with_bias(config.bias)
        .init(device)
}

fn dropout(config: &GptConfig) -> Dropout {
    DropoutConfig::new(config.dropout).init()
}

impl<B: Backend> Block<B> {
    /// A block of a model with `config`. Residual projections get std
    /// 0.02/√(2·n_layer): each block adds two residual branches, so the residual stream's variance
    /// stays independent of depth.
    fn new(config: &GptConfig, device: &B::Device) -> Self {
        let d = config.d_model;
        let resid_std = INIT_STD / ((2 * config.n_layer) as f64).sqrt();
        Self {
            ln_1: layer_norm(config, device),
            attn: CausalSelfAttention {
                c_attn: linear([d, 3 * d], config.bias, INIT_STD, device),
                c_proj: linear([d, d], config.bias, resid_std, device),
                attn_dropout: dropout(config),
                resid_dropout: dropout(config),
                n_head: config.n_head,
            },
            ln_2: layer_norm(config, device),
            mlp: Mlp {
                c_fc: linear([d, 4 * d], config.bias, INIT_STD, device),
                c_proj: linear([4 * d, d], config.bias, resid_std, device),
                dropout: dropout(config),
            },
        }
    }

    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let x = x.clone() + self.attn.forward(self.ln_1.forward(x));
        x.clone() + self.mlp.forward(self.ln_2.forward(x))
    }
}

impl<B: Backend> CausalSelfAttention<B> {
    /// `x: [batch, seq, d] → [batch, seq, d]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, seq, d] = x.dims();
        let heads = self.n_head;
        let split_heads =
            |t: Tensor<B, 3>| t.reshape([batch, seq, heads, d / heads]).swap_dims(1, 2);
        let mut qkv = self
            .c_attn
            .forward(x)
            .chunk(3, 2)
            .into_iter()
            .map(split_heads);
        let (q, k, v) = match (qkv.next(), qkv.next(), qkv.next()) {
            (Some(q), Some(k), Some(v)) => (q, k, v),
            _ => unreachable!("chunk(3) of a [.., 3d] tensor yields three tensors"),
        };
        let y = causal_attention(q, k, v, &self.attn_dropout);
        let y = y.swap_dims(1, 2).reshape([batch, seq, d]);
        self.resid_dropout.forward(self.c_proj.forward(y))
    }
}

/// `softmax(QKᵀ/√d_head + M) V` on `[batch, heads, seq, d_head]` tensors, M = −∞ where the key
/// comes after the query. The decomposed form: fused attention replaces it in a later issue.
pub fn causal_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    dropout: &Dropout,
) -> Tensor<B, 4> {
    let [_, _, seq, d_head] = q.dims();
    // Scaling Q (T·d_head entries per head) rather than the scores (T·T) is the same product.
    let scores = (q * (1.0 / (d_head as f64).sqrt())).matmul(k.swap_dims(2, 3));
    let future = Tensor::<B, 2, Bool>::tril_mask([seq, seq], 0, &scores.device());
    let scores = scores.mask_fill(future.unsqueeze::<4>(), f32::NEG_INFINITY);
    dropout.forward(softmax(scores, 3)).matmul(v)
}

impl<B: Backend> Mlp<B> {
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let hidden = gelu_tanh(self.c_fc.forward(x));
        self.dropout.forward(self.c_proj.forward(hidden))
    }
}

/// GPT-2's GELU, `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`, computed as the equal
/// `x / (1 + exp(−2√(2/π)(x + 0.044715x³)))` (from `½(1 + tanh z) = σ(2z)`), with `x³` as
/// products. Burn's `gelu_approximate` evaluates the same function through `powf` and `tanh`
/// (and Burn's generic sigmoid through `exp`, `log1p` and `exp` again); on the CPU backend that
/// took a quarter of a tiny-model training step, and this form costs one `exp`. For very negative
/// x, `exp` overflows to +∞ and the quotient is the correct limit −0.
pub fn gelu_tanh<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    const MINUS_TWO_SQRT_2_OVER_PI: f64 = -2.0 * 0.797_884_560_802_865_4;
    let cube = x.clone() * x.clone() * x.clone();
    let exponent = (x.clone() + cube * 0.044715) * MINUS_TWO_SQRT_2_OVER_PI;
    x / (exponent.exp() + 1.0)
}

impl<B: Backend> Gpt<B> {
    /// The model (or the stage `stage` of it) with GPT-2's initialisation, drawn from the
    /// backend's RNG: seed it first (`B::seed`) for a reproducible model.
    pub fn new(config: &GptConfig, stage: StageSpec, device: &B::Device) -> Self {
        let normal = Initializer::Normal {
            mean: 0.0,
            std: INIT_STD,
        };
        let embeddings = stage.embedding.then(|| Embeddings {
            wte: EmbeddingConfig::new(config.vocab_size, config.d_model)
                .with_initializer(normal.clone())
                .init(device),
            wpe: EmbeddingConfig::new(config.context, config.d_model)
                .with_initializer(normal.clone())
                .init(device),
            dropout: dropout(config),
        });
        let blocks = (stage.first_block..stage.first_block + stage.n_blocks)
            .map(|_| Block::new(config, device))
            .collect();
        let head = stage.head.then(|| Head {
            ln_f: layer_norm(config, device),
            lm_head: (!config.tie_embeddings)
                .then(|| linear([config.d_model, config.vocab_size], false, INIT_STD, device)),
            wte: None,
        });
        let model = Self {
            embeddings,
            blocks,
            head,
            first_block: stage.first_block,
        };
        model.visit(&mut DrawNow);
        model
    }

    /// Cuts the whole model into the pipeline stages `stages` (contiguous, in order, covering
    /// every block once), moving each part rather than drawing it again: stage models equal
    /// the corresponding parts of the serial model with the same seed, bitwise. A tied head that
    /// lands on another stage than the embedding gets its own copy of `wte` ([`Head::wte`]).
    pub fn split(self, stages: &[StageSpec]) -> Vec<Self> {
        let tied_copy = match (&self.embeddings, &self.head) {
            (Some(embeddings), Some(head)) if head.lm_head.is_none() => {
                Some(embeddings.wte.weight.val())
            }
            _ => None,
        };
        let (mut embeddings, mut head) = (self.embeddings, self.head);
        let mut blocks = self.blocks.into_iter();
        stages
            .iter()
            .map(|stage| {
                let mut stage_head = if stage.head { head.take() } else { None };
                if let Some(head) = &mut stage_head
                    && !stage.embedding
                {
                    head.wte = tied_copy.clone().map(Param::from_tensor);
                }
                Self {
                    embeddings: if stage.embedding {
                        embeddings.take()
                    } else {
                        None
                    },
                    blocks: blocks.by_ref().take(stage.n_blocks).collect(),
                    head: stage_head,
                    first_block: stage.first_block,
                }
            })
            .collect()
    }

    /// Token ids `[batch, seq]` → residual stream `[batch, seq, d]`.
    pub fn embed(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let embeddings = self
            .embeddings
            .as_ref()
            .expect("embed() on a stage without embeddings");
        let [_, seq] = tokens.dims();
        let positions = Tensor::<B, 1, Int>::arange(0..seq as i64, &tokens.device()).unsqueeze();
        let x = embeddings.wte.forward(tokens) + embeddings.wpe.forward(positions);
        embeddings.dropout.forward(x)
    }

    /// The stage's blocks, in order.
    pub fn run_blocks(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.blocks.iter().fold(x, |x, block| block.forward(x))
    }

    /// Residual stream → logits `[batch, seq, V]`. A tied head multiplies by `wteᵀ`.
    pub fn logits(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let head = self
            .head
            .as_ref()
            .expect("logits() on a stage without the head");
        let x = head.ln_f.forward(x);
        if let Some(lm_head) = &head.lm_head {
            return lm_head.forward(x);
        }
        let wte = match (&head.wte, &self.embeddings) {
            (Some(copy), _) => copy,
            (None, Some(embeddings)) => &embeddings.wte.weight,
            (None, None) => unreachable!("split() gives a tied head without the embedding a copy"),
        };
        x.matmul(wte.val().transpose().unsqueeze())
    }

    /// Logits of the whole model.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.logits(self.run_blocks(self.embed(tokens)))
    }
}

/// Summed next-token cross-entropy `Σ −log softmax(logits)[target]` over every position, and the
/// number of positions. Callers divide by the token count of the whole optimizer step, so that
/// gradient accumulation and data parallelism weight every token equally.
pub fn cross_entropy_sum<B: Backend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
) -> (Tensor<B, 1>, usize) {
    let [batch, seq, vocab] = logits.dims();
    let log_probs = log_softmax(logits.reshape([batch * seq, vocab]), 1);
    let picked = log_probs.gather(1, targets.reshape([batch * seq, 1]));
    (picked.sum().neg(), batch * seq)
}
