//! GPT-2 modules: embeddings, pre-LayerNorm blocks (causal self-attention with a fused QKV
//! projection, GELU(tanh) MLP of width 4d), final LayerNorm and LM head.
//!
//! Parameter names follow Hugging Face's GPT-2 (`wte`, `wpe`, `ln_1`, `attn.c_attn`, `mlp.c_fc`,
//! …) so that importing and exporting weights is a rename of the block prefix and of LayerNorm's
//! gamma/beta. Linear weights are stored `[in, out]` (Burn's row layout, like GPT-2's Conv1D).

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig,
    LinearConfig,
};
use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Distribution, FloatDType, Int, Tensor};
use wildfire_backend::DecoratedBackend;
use wildfire_backend::comm::{CommError, split_ranges};
use wildfire_backend::kernels::attention::{fused_qkv_attention, unpack};
use wildfire_backend::kernels::bias_gelu::bias_gelu;
use wildfire_backend::kernels::gelu_tanh_f32;
use wildfire_backend::kernels::layer_norm::layer_norm as fused_layer_norm;
use wildfire_parallel::precision::{Precision, in_dtype, in_fp32};
use wildfire_parallel::tp::{
    ActivationPart, ParallelEmbedding, ParallelLinear, TensorParallel, TpStyle,
    vocab_parallel_cross_entropy,
};

use super::{GptConfig, StageSpec};

/// Standard deviation of GPT-2's initialisation.
const INIT_STD: f64 = 0.02;
/// LayerNorm epsilon of GPT-2.
const LN_EPS: f64 = 1e-5;

/// The tensor-parallel plan of the GPT (Megatron-LM's): attention split by heads (the fused QKV
/// projection column-parallel per section, so each rank gets the same heads of Q, K and V; the
/// output projection row-parallel), the MLP column- then row-parallel, the vocabulary split in
/// the token embedding and the LM head (and in a tied head's copy of the embedding), the
/// LayerNorms in the sequence-parallel region (the sequence is dimension 1 of the residual
/// stream, [`SEQUENCE_DIM`]). Everything else (the position embedding) is replicated. Applied by
/// `wildfire_parallel::tp::apply_plan`, like any model's plan.
pub const TP_PLAN: &[(&str, TpStyle)] = &[
    ("embeddings.wte", TpStyle::VocabRows),
    ("blocks.*.ln_1", TpStyle::SequenceRegion),
    (
        "blocks.*.attn.c_attn",
        TpStyle::Column {
            sections: 3,
            gather_output: false,
        },
    ),
    ("blocks.*.attn.c_proj", TpStyle::Row),
    ("blocks.*.ln_2", TpStyle::SequenceRegion),
    ("blocks.*.mlp.c_fc", TpStyle::COLUMN),
    ("blocks.*.mlp.c_proj", TpStyle::Row),
    ("head.ln_f", TpStyle::SequenceRegion),
    ("head.lm_head", TpStyle::VocabColumns),
    ("head.wte", TpStyle::VocabRows),
];

/// [`TP_PLAN`]'s rules that name parameters of the whole model of `config`, the plan to split it
/// by (before a pipeline split): without `head.wte`, the copy of the table a pipeline split
/// gives a tied head on another stage (made from the already split table), and without
/// `head.lm_head` where the head is tied.
pub fn whole_model_rules(config: &GptConfig) -> Vec<(&'static str, TpStyle)> {
    TP_PLAN
        .iter()
        .filter(|(path, _)| match *path {
            "head.wte" => false,
            "head.lm_head" => !config.tie_embeddings,
            _ => true,
        })
        .copied()
        .collect()
}

/// The sequence dimension of the residual stream `[batch, seq, d]`, which sequence parallelism
/// splits.
pub const SEQUENCE_DIM: usize = 1;

/// A collective inside the model's forward. The forward has no error path (Burn's modules
/// return tensors), so a failed collective (a peer that died) ends this rank with its cause.
fn collective<T>(result: Result<T, CommError>) -> T {
    result.unwrap_or_else(|error| panic!("tensor-parallel collective failed: {error}"))
}

/// Dropout of `x`, which is `part` of the serial model's activation (the whole when `None`): the
/// mask is drawn for the whole activation and cut, so every rank of a tensor-parallel group
/// draws the same numbers. Masks therefore agree where ranks hold the same activation (outside
/// the tensor-parallel region), differ where they hold different heads or sequence parts, and
/// equal the serial model's masks for the same seed.
///
/// Each rank thus draws `tp` times the random numbers it uses. The part is copied out of the
/// whole mask: the product saves its mask for the backward, and a view (Flex's `narrow`) would
/// keep the whole mask alive until then.
fn dropout_part<B: Backend, const D: usize>(
    dropout: &Dropout,
    x: Tensor<B, D>,
    part: Option<ActivationPart>,
) -> Tensor<B, D> {
    let device = x.device();
    if !B::ad_enabled(&device) || dropout.prob == 0.0 {
        return x;
    }
    let keep = 1.0 - dropout.prob;
    let mut whole = x.dims();
    if let Some(part) = &part {
        whole[part.dim] = part.whole;
    }
    let mut mask = Tensor::<B, D>::random(whole, Distribution::Bernoulli(keep), &device);
    if let Some(part) = part {
        let view = mask.narrow(part.dim, part.range.start, part.range.len());
        mask = Tensor::from_data(view.into_data(), &device);
    }
    // Drawn in the default float type whatever the compute type, so every precision draws the
    // same masks; 0 and 1 are exact in any type.
    let mask = in_dtype(mask, FloatDType::from(x.dtype()));
    (x * mask) * (1.0 / keep)
}

/// `gelu_tanh(linear.forward(x))`, with the bias add and GELU fused into one op each way
/// ([`bias_gelu`]), after the sum over ranks where the layer is row-parallel.
fn linear_gelu<B: DecoratedBackend, const D: usize>(
    linear: &ParallelLinear<B>,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    linear.forward_with(x, fused_bias_gelu)
}

/// `g(y + b)` as the fused op, `b` the fp32 bias as it is (the op computes in f32); a zero bias
/// stands in for none (it is no parameter, so no gradient is computed for it).
fn fused_bias_gelu<B: DecoratedBackend, const D: usize>(
    y: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    let bias = bias.unwrap_or_else(|| Tensor::zeros([y.dims()[D - 1]], &y.device()));
    bias_gelu(y, bias)
}

/// Token and learned position embeddings, `h₀ = dropout(wte[x] + wpe[0..T])`.
#[derive(Module, Debug)]
pub struct Embeddings<B: Backend> {
    pub wte: ParallelEmbedding<B>,
    pub wpe: Embedding<B>,
    pub dropout: Dropout,
}

/// Causal multi-head self-attention: `softmax(QKᵀ/√d_head + M)V` per head, with M = −∞ above the
/// diagonal, then the output projection.
#[derive(Module, Debug)]
pub struct CausalSelfAttention<B: Backend> {
    /// Fused Q, K, V projection, `[d, 3d]`.
    pub c_attn: ParallelLinear<B>,
    /// Output projection, `[d, d]` (a residual projection: scaled initialisation).
    pub c_proj: ParallelLinear<B>,
    pub attn_dropout: Dropout,
    pub resid_dropout: Dropout,
    /// The model's heads (a tensor-parallel rank computes those of its columns of `c_attn`).
    pub n_head: usize,
    /// Whether the attention core runs as one fused op with its fused backward
    /// (`wildfire_backend::kernels::attention`) rather than as decomposed ops. It does only where
    /// `attn_dropout` is 0: the fused op has no dropout of the attention weights.
    #[module(skip)]
    pub fused: bool,
}

/// `c_proj(gelu_tanh(c_fc(x)))`, hidden width 4d.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    pub c_fc: ParallelLinear<B>,
    pub c_proj: ParallelLinear<B>,
    pub dropout: Dropout,
    /// Whether `c_fc`'s bias add and the GELU run as one fused op with its fused backward
    /// ([`linear_gelu`]) rather than as decomposed ops.
    #[module(skip)]
    pub fused: bool,
}

/// Pre-LayerNorm transformer block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub ln_1: LayerNorm<B>,
    pub attn: CausalSelfAttention<B>,
    pub ln_2: LayerNorm<B>,
    pub mlp: Mlp<B>,
    /// Whether the LayerNorms run as one fused op with its fused backward
    /// (`wildfire_backend::kernels::layer_norm`) rather than as Burn's decomposed ops.
    #[module(skip)]
    pub fused_norm: bool,
}

/// Final LayerNorm and, when embeddings are untied, the LM head `[d, V]`.
#[derive(Module, Debug)]
pub struct Head<B: Backend> {
    pub ln_f: LayerNorm<B>,
    pub lm_head: Option<ParallelLinear<B>>,
    /// As [`Block::fused_norm`], for `ln_f`.
    #[module(skip)]
    pub fused_norm: bool,
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
    /// Under tensor parallelism, the group and whether the residual stream is split along the
    /// sequence (filled in by the plan).
    pub tp: TensorParallel<B>,
    /// The vocabulary size, whose rows tensor-parallel ranks split (`split_ranges`).
    #[module(skip)]
    pub vocab: usize,
    /// The type the residual stream and the matmuls compute in (the parameters stay fp32; see
    /// `wildfire_parallel::precision`).
    #[module(skip)]
    pub precision: Precision,
    /// Full activation checkpointing: the pipeline executor keeps each block's input only and
    /// recomputes the block in the backward (see `wildfire_parallel::pp::executor`).
    #[module(skip)]
    pub recompute_blocks: bool,
}

/// A linear layer initialised as GPT-2 does: weights N(0, std²), biases zero. Every linear layer
/// of the model is built here, whole; a plan ([`TP_PLAN`]) may then split it.
fn linear<B: Backend>(
    [d_in, d_out]: [usize; 2],
    bias: bool,
    std: f64,
    device: &B::Device,
) -> ParallelLinear<B> {
    let mut layer = LinearConfig::new(d_in, d_out)
        .with_bias(bias)
        .with_initializer(Initializer::Normal { mean: 0.0, std })
        .init(device);
    layer.bias = layer.bias.map(|b| Param::from_tensor(b.val().zeros_like()));
    ParallelLinear::from(layer)
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
                fused: true,
            },
            ln_2: layer_norm(config, device),
            mlp: Mlp {
                c_fc: linear([d, 4 * d], config.bias, INIT_STD, device),
                c_proj: linear([4 * d, d], config.bias, resid_std, device),
                dropout: dropout(config),
                fused: true,
            },
            fused_norm: true,
        }
    }
}

impl<B: DecoratedBackend> Block<B> {
    /// `x: [batch, seq, d]` (under sequence parallelism this rank's part of the sequence).
    pub fn forward(&self, x: Tensor<B, 3>, tp: &TensorParallel<B>) -> Tensor<B, 3> {
        let ln_1 = layer_norm_fp32(&self.ln_1, x.clone(), self.fused_norm);
        let x = x + self.attn.forward(ln_1, tp);
        let ln_2 = layer_norm_fp32(&self.ln_2, x.clone(), self.fused_norm);
        x + self.mlp.forward(ln_2, tp)
    }
}

impl<B: DecoratedBackend> CausalSelfAttention<B> {
    /// `x: [batch, seq, d] → [batch, seq, d]` (under sequence parallelism, this rank's part of
    /// the sequence in and out; the QKV projection gathers the whole sequence).
    pub fn forward(&self, x: Tensor<B, 3>, tp: &TensorParallel<B>) -> Tensor<B, 3> {
        let qkv = self.c_attn.forward(x);
        let [batch, seq, width] = qkv.dims();
        // This rank's heads: those of its columns of each of Q, K and V.
        let d_head = self.c_proj.weight.dims()[1] / self.n_head;
        let (d, heads) = (width / 3, width / 3 / d_head);
        // `[batch, seq, 3·heads, d_head]` is the projection's own layout: Q, K and V are views
        // of it (`unpack`; reshaping each third would copy), and the fused op takes it whole.
        let sections = qkv.reshape([batch, seq, 3 * heads, d / heads]);
        // A split projection gives this rank a contiguous range of the heads (the QKV columns
        // are split per section, at head boundaries).
        let (rank, size) = self.c_attn.tp.rank_and_size();
        let head_part = (size > 1).then(|| ActivationPart {
            dim: 1,
            range: rank * heads..(rank + 1) * heads,
            whole: heads * size,
        });
        let y = match self.fused && self.attn_dropout.prob == 0.0 {
            true => fused_qkv_attention(sections, true),
            false => {
                let [q, k, v] = unpack(sections);
                causal_attention(q, k, v, &self.attn_dropout, head_part)
            }
        };
        let y = self
            .c_proj
            .forward(y.swap_dims(1, 2).reshape([batch, seq, d]));
        let part = tp.sequence_part(y.dims()[SEQUENCE_DIM]);
        dropout_part(&self.resid_dropout, y, part)
    }
}

/// `softmax(QKᵀ/√d_head + M) V` on `[batch, heads, seq, d_head]` tensors, M = −∞ where the key
/// comes after the query; the attention weights' dropout mask is `heads`'s part of the whole
/// model's (see [`dropout_part`]). The decomposed form, for attention with dropout (and for
/// comparison): without dropout the model runs fused attention.
pub fn causal_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    dropout: &Dropout,
    heads: Option<ActivationPart>,
) -> Tensor<B, 4> {
    let [_, _, seq, d_head] = q.dims();
    // Scaling Q (T·d_head entries per head) rather than the scores (T·T) is the same product.
    let scores = (q * (1.0 / (d_head as f64).sqrt())).matmul(k.swap_dims(2, 3));
    let future = Tensor::<B, 2, Bool>::tril_mask([seq, seq], 0, &scores.device());
    let scores = scores.mask_fill(future.unsqueeze::<4>(), f32::NEG_INFINITY);
    let weights = in_fp32(scores, |scores| softmax(scores, 3));
    dropout_part(dropout, weights, heads).matmul(v)
}

impl<B: DecoratedBackend> Mlp<B> {
    pub fn forward(&self, x: Tensor<B, 3>, tp: &TensorParallel<B>) -> Tensor<B, 3> {
        let hidden = match self.fused {
            true => linear_gelu(&self.c_fc, x),
            false => gelu_tanh(self.c_fc.forward(x)),
        };
        let y = self.c_proj.forward(hidden);
        let part = tp.sequence_part(y.dims()[SEQUENCE_DIM]);
        dropout_part(&self.dropout, y, part)
    }
}

/// LayerNorm computed in fp32 (its fp32 parameters on the input cast up), returned in the
/// input's type: its mean and variance lose too much in half precision. `fused`: as the fused
/// op ([`fused_layer_norm`]), else as Burn's decomposed ops.
fn layer_norm_fp32<B: DecoratedBackend>(
    norm: &LayerNorm<B>,
    x: Tensor<B, 3>,
    fused: bool,
) -> Tensor<B, 3> {
    in_fp32(x, |x| match fused {
        true => fused_layer_norm(
            x,
            norm.gamma.val(),
            norm.beta.as_ref().map(Param::val),
            LN_EPS,
        ),
        false => norm.forward(x),
    })
}

/// GPT-2's GELU, `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`, in fp32 whatever `x`'s type
/// ([`gelu_tanh_f32`] states the form and its clamp). On the CPU backend Burn's
/// `gelu_approximate` took a quarter of a tiny-model training step; this form costs one `exp`.
pub fn gelu_tanh<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    in_fp32(x, gelu_tanh_f32)
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
                .init(device)
                .into(),
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
            fused_norm: true,
        });
        let model = Self {
            embeddings,
            blocks,
            head,
            first_block: stage.first_block,
            tp: TensorParallel::new(),
            vocab: config.vocab_size,
            precision: Precision::Fp32,
            recompute_blocks: false,
        };
        model.visit(&mut DrawNow);
        model
    }

    /// The same model with its fused ops on or off: the attention core (see
    /// `CausalSelfAttention::fused`; it stays off where the attention weights have dropout),
    /// the MLP's bias + GELU (see `Mlp::fused`) and the LayerNorms (see `Block::fused_norm`).
    pub fn with_fused_ops(mut self, on: bool) -> Self {
        for block in &mut self.blocks {
            block.attn.fused = on;
            block.mlp.fused = on;
            block.fused_norm = on;
        }
        if let Some(head) = &mut self.head {
            head.fused_norm = on;
        }
        self
    }

    /// The same model computing in `precision`'s type.
    pub fn with_precision(self, precision: Precision) -> Self {
        Self { precision, ..self }
    }

    /// The same model, recomputing each block in the backward when `on` (full activation
    /// checkpointing).
    pub fn with_recomputed_blocks(self, on: bool) -> Self {
        Self {
            recompute_blocks: on,
            ..self
        }
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
                    tp: self.tp.clone(),
                    vocab: self.vocab,
                    precision: self.precision,
                    recompute_blocks: self.recompute_blocks,
                }
            })
            .collect()
    }
}

impl<B: DecoratedBackend> Gpt<B> {
    /// Token ids `[batch, seq]` → residual stream `[batch, seq, d]` (under sequence parallelism,
    /// this rank's part of the sequence).
    pub fn embed(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let embeddings = self
            .embeddings
            .as_ref()
            .expect("embed() on a stage without embeddings");
        let [_, seq] = tokens.dims();
        let positions = Tensor::<B, 1, Int>::arange(0..seq as i64, &tokens.device()).unsqueeze();
        let x = in_dtype(
            embeddings.wte.forward(tokens) + embeddings.wpe.forward(positions),
            self.precision.compute_dtype(),
        );
        let x = self.tp.enter_sequence_region(x);
        let part = self.tp.sequence_part(x.dims()[SEQUENCE_DIM]);
        dropout_part(&embeddings.dropout, x, part)
    }

    /// The stage's blocks, in order.
    pub fn run_blocks(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let tp = &self.tp;
        self.blocks.iter().fold(x, |x, block| block.forward(x, tp))
    }

    /// Residual stream → logits `[batch, seq, V]` (under tensor parallelism this rank's
    /// vocabulary columns, `[batch, seq, V/tp]`, over the whole sequence). A tied head
    /// multiplies by `wteᵀ` (this rank's rows of it).
    pub fn logits(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let head = self
            .head
            .as_ref()
            .expect("logits() on a stage without the head");
        let x = layer_norm_fp32(&head.ln_f, x, head.fused_norm);
        if let Some(lm_head) = &head.lm_head {
            return lm_head.forward(x);
        }
        let wte = match (&head.wte, &self.embeddings) {
            (Some(copy), _) => copy,
            (None, Some(embeddings)) => &embeddings.wte.weight,
            (None, None) => unreachable!("split() gives a tied head without the embedding a copy"),
        };
        // The head is column-parallel in the vocabulary: its input enters the tensor-parallel
        // region as a column-parallel layer's does.
        let x = self.tp.enter_parallel_region(x);
        let wte = in_dtype(wte.val(), FloatDType::from(x.dtype()));
        x.matmul(wte.transpose().unsqueeze())
    }

    /// Logits of the whole model.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.logits(self.run_blocks(self.embed(tokens)))
    }

    /// The summed next-token cross-entropy of `logits` (from [`Gpt::logits`]): under tensor
    /// parallelism from this rank's vocabulary columns, without gathering the full logits, the
    /// same value on every rank.
    pub fn loss_sum(&self, logits: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let logits = in_dtype(logits, FloatDType::F32);
        match self.tp.group() {
            None => cross_entropy_sum(logits, targets).0,
            Some(group) => {
                let rows = &split_ranges(self.vocab, group.size())[group.rank()];
                collective(vocab_parallel_cross_entropy(
                    logits, targets, rows.start, group,
                ))
            }
        }
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
