//! The modules: embeddings, pre-norm blocks (causal self-attention, MLP), final norm and LM
//! head, each with its GPT-2 and its Llama form ([`super::ModelKind`]):
//!
//! | part | GPT-2 | Llama |
//! |---|---|---|
//! | norms (`ln_1`, `ln_2`, `ln_f`) | LayerNorm, `gamma` and `beta` | RMSNorm, `gamma` |
//! | positions | learned, `embeddings.wpe` | rotary, on Q and K ([`super::rope`]) |
//! | attention | fused `attn.c_attn` `[d, 3d]` | `attn.q_proj`, `k_proj`, `v_proj` (grouped) |
//! | MLP | `c_proj(gelu(c_fc(x)))` | `c_proj(silu(gate(x)) ⊙ c_fc(x))` (SwiGLU) |
//!
//! Both share the output projection `attn.c_proj`, `mlp.c_fc` and `mlp.c_proj`. Parameter names
//! follow Hugging Face's GPT-2 (`wte`, `wpe`, `ln_1`, `attn.c_attn`, `mlp.c_fc`, …) so that
//! importing and exporting GPT-2 weights is a rename of the block prefix and of LayerNorm's
//! gamma/beta. Linear weights are stored `[in, out]` (Burn's row layout, like GPT-2's Conv1D).

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Dropout, DropoutConfig, Embedding, EmbeddingConfig, Initializer, LinearConfig};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Distribution, FloatDType, Int, Tensor, TensorData, TensorPrimitive};
use wildfire_backend::DecoratedBackend;
use wildfire_backend::comm::CommError;
use wildfire_backend::kernels::attention::{fused_attention, fused_qkv_attention, unpack};
use wildfire_backend::kernels::bias_gelu::bias_gelu;
use wildfire_backend::kernels::choice::{FusedOp, FusedOps};
use wildfire_backend::kernels::cross_entropy::{
    HeadLayout, IGNORE_INDEX, LinearCrossEntropy, logits_cross_entropy_sum,
};
use wildfire_backend::kernels::gelu_tanh_f32;
use wildfire_backend::kernels::layer_norm::{
    layer_norm as fused_layer_norm, rms_norm as fused_rms_norm,
};
use wildfire_backend::kernels::swiglu::swiglu;
use wildfire_parallel::precision::{Precision, in_dtype, in_fp32};
use wildfire_parallel::tp::{
    ActivationPart, ParallelEmbedding, ParallelLinear, TensorParallel, TpStyle,
    vocab_parallel_cross_entropy, vocabulary_share,
};

use super::rope::Rotary;
use super::{GptConfig, ModelKind, StageSpec};

/// Standard deviation of GPT-2's initialisation (Llama's too).
const INIT_STD: f64 = 0.02;

/// The tensor-parallel plan of both model kinds (Megatron-LM's): attention split by heads (GPT's
/// fused QKV projection column-parallel per section, so each rank gets the same heads of Q, K
/// and V; Llama's Q, K and V projections each column-parallel, so a rank holds the key/value
/// heads its query heads use, or shares one with other ranks where it has fewer than ranks: see
/// [`tp_rules`]; the output projection row-parallel), the MLP column- then
/// row-parallel (Llama's gate as its `c_fc`), the vocabulary split in the token embedding and
/// the LM head (and in a tied head's copy of the embedding), the norms in the
/// sequence-parallel region (the sequence is dimension 1 of the residual stream,
/// [`SEQUENCE_DIM`]). Everything else (GPT's position embedding) is replicated. Applied by
/// `wildfire_parallel::tp::apply_plan`, like any model's plan; [`whole_model_rules`] picks the
/// rules of one model.
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
    ("blocks.*.attn.q_proj", TpStyle::COLUMN),
    ("blocks.*.attn.k_proj", TpStyle::COLUMN),
    ("blocks.*.attn.v_proj", TpStyle::COLUMN),
    ("blocks.*.attn.c_proj", TpStyle::Row),
    ("blocks.*.attn.q_norm", TpStyle::HeadShared),
    ("blocks.*.attn.k_norm", TpStyle::HeadShared),
    ("blocks.*.ln_2", TpStyle::SequenceRegion),
    ("blocks.*.mlp.gate", TpStyle::COLUMN),
    ("blocks.*.mlp.c_fc", TpStyle::COLUMN),
    ("blocks.*.mlp.c_proj", TpStyle::Row),
    ("head.ln_f", TpStyle::SequenceRegion),
    ("head.lm_head", TpStyle::VocabColumns),
    ("head.wte", TpStyle::VocabRows),
];

/// [`TP_PLAN`] for the model of `config`: Llama's key/value projections split by its
/// key/value heads (whole heads per rank where the tensor-parallel degree divides them, as
/// `TP_PLAN`'s column split; a head shared by several ranks where they divide it).
pub fn tp_rules(config: &GptConfig) -> Vec<(&'static str, TpStyle)> {
    let kv_heads = TpStyle::ColumnHeads {
        heads: config.n_kv_head,
    };
    let rule = |&(path, style): &(&'static str, TpStyle)| match path {
        "blocks.*.attn.k_proj" | "blocks.*.attn.v_proj" => (path, kv_heads),
        _ => (path, style),
    };
    TP_PLAN.iter().map(rule).collect()
}

/// [`tp_rules`] that name parameters of the whole model of `config`, the plan to split it by
/// (before a pipeline split): the rules of its kind's layers, without `head.wte`, the copy of
/// the table a pipeline split gives a tied head on another stage (made from the already split
/// table), and without `head.lm_head` where the head is tied.
pub fn whole_model_rules(config: &GptConfig) -> Vec<(&'static str, TpStyle)> {
    let llama = config.kind == ModelKind::Llama;
    tp_rules(config)
        .into_iter()
        .filter(|(path, _)| match *path {
            "head.wte" => false,
            "head.lm_head" => !config.tie_embeddings,
            "blocks.*.attn.c_attn" => !llama,
            "blocks.*.attn.q_proj" | "blocks.*.attn.k_proj" | "blocks.*.attn.v_proj" => llama,
            "blocks.*.mlp.gate" => llama,
            "blocks.*.attn.q_norm" | "blocks.*.attn.k_norm" => config.qk_norm,
            _ => true,
        })
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

/// Token and (GPT) learned position embeddings, `h₀ = dropout(wte[x] + wpe[0..T])`.
#[derive(Module, Debug)]
pub struct Embeddings<B: Backend> {
    pub wte: ParallelEmbedding<B>,
    /// GPT's position embedding; Llama rotates Q and K instead.
    pub wpe: Option<Embedding<B>>,
    pub dropout: Dropout,
}

/// LayerNorm (GPT) or RMSNorm (Llama) over the last dimension, computed in fp32:
/// `(x − mean)/√(var + ε)·γ + β`, or `x/√(mean(x²) + ε)·γ`.
#[derive(Module, Debug)]
pub struct Norm<B: Backend> {
    pub gamma: Param<Tensor<B, 1>>,
    /// LayerNorm's shift (GPT with biases).
    pub beta: Option<Param<Tensor<B, 1>>>,
    /// RMSNorm rather than LayerNorm.
    #[module(skip)]
    pub rms: bool,
    #[module(skip)]
    pub eps: f64,
}

/// Causal multi-head self-attention: `softmax(QKᵀ/√d_head + M)V` per head, with M = −∞ above the
/// diagonal, then the output projection. Under grouped-query attention (Llama) query heads
/// `g·j … g·j + g − 1` share key/value head `j`, `g = n_head / n_kv_head`.
#[derive(Module, Debug)]
pub struct CausalSelfAttention<B: Backend> {
    /// GPT's fused Q, K, V projection, `[d, 3d]`.
    pub c_attn: Option<ParallelLinear<B>>,
    /// Llama's query projection, `[d, n_head·d_head]` (`[d, d]` unless the heads are set apart).
    pub q_proj: Option<ParallelLinear<B>>,
    /// Llama's key projection, `[d, n_kv_head·d_head]`.
    pub k_proj: Option<ParallelLinear<B>>,
    /// Llama's value projection, `[d, n_kv_head·d_head]`.
    pub v_proj: Option<ParallelLinear<B>>,
    /// Qwen3's RMSNorm of each head of Q, and of K (γ of `d_head`), before the rotation.
    pub q_norm: Option<Norm<B>>,
    pub k_norm: Option<Norm<B>>,
    /// Output projection, `[n_head·d_head, d]` (a residual projection: scaled initialisation).
    pub c_proj: ParallelLinear<B>,
    pub attn_dropout: Dropout,
    pub resid_dropout: Dropout,
    /// The model's heads (a tensor-parallel rank computes those of its columns of the Q, K, V
    /// projections).
    pub n_head: usize,
    /// The model's key/value heads.
    pub n_kv_head: usize,
    /// The width of one head.
    pub d_head: usize,
    /// Llama's rotary embedding of Q and K.
    #[module(skip)]
    pub rotary: Option<Rotary>,
    /// Whether the attention core runs as one fused op with its fused backward
    /// (`wildfire_backend::kernels::attention`) rather than as decomposed ops (it does only where
    /// `attn_dropout` is 0: the fused op has no dropout of the attention weights).
    #[module(skip)]
    pub fused: bool,
    /// Whether Llama's rotary embedding runs as one op each way
    /// (`wildfire_backend::kernels::rope`).
    #[module(skip)]
    pub fused_rope: bool,
    /// Whether the norms of Q's and K's heads run as the fused RMSNorm op.
    #[module(skip)]
    pub fused_qk_norm: bool,
    /// Mistral's sliding window (see `GptConfig::sliding_window`). The fused attention op has
    /// no window, so a windowed model runs the decomposed attention.
    #[module(skip)]
    pub window: Option<usize>,
}

/// `c_proj(gelu_tanh(c_fc(x)))` (GPT, hidden width 4d), or SwiGLU
/// `c_proj(silu(gate(x)) ⊙ c_fc(x))` (Llama; `c_fc` is Hugging Face's `up_proj`, `c_proj` its
/// `down_proj`).
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    pub c_fc: ParallelLinear<B>,
    /// SwiGLU's gate projection (Llama).
    pub gate: Option<ParallelLinear<B>>,
    pub c_proj: ParallelLinear<B>,
    pub dropout: Dropout,
    /// Whether `c_fc`'s bias add and the GELU (GPT), or SwiGLU's `silu(g) ⊙ u` (Llama), run as
    /// one fused op with its fused backward ([`linear_gelu`], `wildfire_backend::kernels::swiglu`)
    /// rather than as decomposed ops.
    #[module(skip)]
    pub fused: bool,
}

/// Pre-norm transformer block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub ln_1: Norm<B>,
    pub attn: CausalSelfAttention<B>,
    pub ln_2: Norm<B>,
    pub mlp: Mlp<B>,
    /// Whether the norms (LayerNorm or RMSNorm) run as one fused op with its fused backward
    /// (`wildfire_backend::kernels::layer_norm`) rather than as Burn's decomposed ops.
    #[module(skip)]
    pub fused_norm: bool,
}

/// Final norm and, when embeddings are untied, the LM head `[d, V]`.
#[derive(Module, Debug)]
pub struct Head<B: Backend> {
    pub ln_f: Norm<B>,
    pub lm_head: Option<ParallelLinear<B>>,
    /// As [`Block::fused_norm`], for `ln_f`.
    #[module(skip)]
    pub fused_norm: bool,
    /// Whether the loss is the fused cross-entropy, which scores the head block by block
    /// without the whole logits ([`Gpt::head_loss_sum`]), or computed from the logits.
    #[module(skip)]
    pub fused_loss: bool,
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
    /// The vocabulary size, whose rows tensor-parallel ranks split ([`vocabulary_share`]).
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

/// A norm of `config`'s kind: γ = 1 and (LayerNorm with biases) β = 0.
fn norm<B: Backend>(config: &GptConfig, device: &B::Device) -> Norm<B> {
    norm_of_width(config, config.d_model, device)
}

/// A norm of `config`'s kind over `width` features.
fn norm_of_width<B: Backend>(config: &GptConfig, width: usize, device: &B::Device) -> Norm<B> {
    let rms = config.kind == ModelKind::Llama;
    let gamma = Tensor::ones([width], device);
    Norm {
        gamma: Param::from_tensor(gamma.clone()),
        beta: (config.bias && !rms).then(|| Param::from_tensor(gamma.zeros_like())),
        rms,
        eps: config.norm_eps,
    }
}

fn dropout(config: &GptConfig) -> Dropout {
    DropoutConfig::new(config.dropout).init()
}

impl<B: Backend> Block<B> {
    /// A block of a model with `config`. Residual projections get std
    /// 0.02/√(2·n_layer): each block adds two residual branches, so the residual stream's variance
    /// stays independent of depth.
    fn new(config: &GptConfig, rotary: Option<&Rotary>, device: &B::Device) -> Self {
        let (d, d_q, d_kv, f, bias) = (
            config.d_model,
            config.q_width(),
            config.kv_width(),
            config.ffn_hidden,
            config.bias,
        );
        let resid_std = INIT_STD / ((2 * config.n_layer) as f64).sqrt();
        let llama = config.kind == ModelKind::Llama;
        let projection = |width, bias| llama.then(|| linear([d, width], bias, INIT_STD, device));
        let qkv_bias = bias || config.qkv_bias;
        let head_norm =
            || (config.qk_norm).then(|| norm_of_width(config, config.head_dim(), device));
        Self {
            ln_1: norm(config, device),
            attn: CausalSelfAttention {
                c_attn: (!llama).then(|| linear([d, 3 * d], bias, INIT_STD, device)),
                q_proj: projection(d_q, qkv_bias),
                k_proj: projection(d_kv, qkv_bias),
                v_proj: projection(d_kv, qkv_bias),
                q_norm: head_norm(),
                k_norm: head_norm(),
                fused_qk_norm: true,
                c_proj: linear([d_q, d], bias, resid_std, device),
                attn_dropout: dropout(config),
                resid_dropout: dropout(config),
                n_head: config.n_head,
                n_kv_head: config.n_kv_head,
                d_head: config.head_dim(),
                window: config.sliding_window,
                rotary: rotary.cloned(),
                fused: true,
                fused_rope: true,
            },
            ln_2: norm(config, device),
            mlp: Mlp {
                gate: projection(f, bias),
                c_fc: linear([d, f], bias, INIT_STD, device),
                c_proj: linear([f, d], bias, resid_std, device),
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
        let ln_1 = self.ln_1.forward(x.clone(), self.fused_norm);
        let x = x + self.attn.forward(ln_1, tp);
        let ln_2 = self.ln_2.forward(x.clone(), self.fused_norm);
        x + self.mlp.forward(ln_2, tp)
    }
}

impl<B: DecoratedBackend> CausalSelfAttention<B> {
    /// `x: [batch, seq, d] → [batch, seq, d]` (under sequence parallelism, this rank's part of
    /// the sequence in and out; the QKV projection gathers the whole sequence).
    pub fn forward(&self, x: Tensor<B, 3>, tp: &TensorParallel<B>) -> Tensor<B, 3> {
        let fused = self.fused && self.attn_dropout.prob == 0.0 && self.window.is_none();
        let y = match (fused, &self.c_attn) {
            (true, Some(_)) => fused_qkv_attention(self.sections(x, 0), true),
            // Llama's key/value heads read where they lie, shared by their query heads.
            (true, None) => {
                let [q, k, v] = self.grouped_heads(x, 0);
                fused_attention(q, k, v, true)
            }
            (false, _) => {
                let [q, k, v] = unpack(self.sections(x, 0));
                let head_part = self.head_part(q.dims()[1]);
                causal_attention(q, k, v, &self.attn_dropout, head_part, self.window)
            }
        };
        let [batch, heads, seq, d_head] = y.dims();
        let y = self
            .c_proj
            .forward(y.swap_dims(1, 2).reshape([batch, seq, heads * d_head]));
        let part = tp.sequence_part(y.dims()[SEQUENCE_DIM]);
        dropout_part(&self.resid_dropout, y, part)
    }

    /// Where this rank's `heads` lie among the model's: a split projection gives each rank a
    /// contiguous range of the heads (the columns are split per section, at head boundaries).
    fn head_part(&self, heads: usize) -> Option<ActivationPart> {
        let (rank, size) = self.c_proj.tp.rank_and_size();
        (size > 1).then(|| ActivationPart {
            dim: 1,
            range: rank * heads..(rank + 1) * heads,
            whole: heads * size,
        })
    }
}

impl<B: DecoratedBackend> CausalSelfAttention<B> {
    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.d_head
    }

    /// Q, K and V of `x` (at positions `start..`, which Llama's rotation needs) in the fused
    /// QKV layout `[batch, seq, 3·heads, d_head]`, Q's heads, then K's, then V's.
    pub fn sections(&self, x: Tensor<B, 3>, start: usize) -> Tensor<B, 4> {
        let d_head = self.head_dim();
        match &self.c_attn {
            Some(c_attn) => {
                let qkv = c_attn.forward(x);
                let [batch, seq, width] = qkv.dims();
                // `[batch, seq, 3·heads, d_head]` is the projection's own layout: Q, K and V
                // are views of it (`unpack`; reshaping each third would copy), and the fused op
                // takes it whole.
                qkv.reshape([batch, seq, width / d_head, d_head])
            }
            None => {
                // This rank's query heads per key/value head: `n_head / n_kv_head` where the
                // plan splits both, all its query heads where ranks share one key/value head.
                let [q, k, v] = self.grouped_heads(x, start).map(|t| t.swap_dims(1, 2));
                let group = q.dims()[2] / k.dims()[2];
                Tensor::cat(vec![q, repeat_heads(k, group), repeat_heads(v, group)], 2)
            }
        }
    }

    /// Llama's Q, K and V of `x` at positions `start..`: projected, Q and K rotated, each
    /// `[batch, heads, seq, d_head]` with K and V of this rank's key/value heads (a rank's query
    /// heads use exactly its key/value heads, as both are split in head order, or the one
    /// key/value head it shares with other ranks where there are fewer than ranks).
    fn grouped_heads(&self, x: Tensor<B, 3>, start: usize) -> [Tensor<B, 4>; 3] {
        let d_head = self.head_dim();
        let project = |layer: &Option<ParallelLinear<B>>| {
            let y = layer
                .as_ref()
                .expect("Llama attention has Q, K, V projections");
            let y = y.forward(x.clone());
            let [batch, seq, width] = y.dims();
            y.reshape([batch, seq, width / d_head, d_head])
        };
        // Qwen3 normalises each head of Q and K: `[batch, seq, heads, d_head]` as rows of d_head.
        let per_head = |y: Tensor<B, 4>, norm: &Option<Norm<B>>| match norm {
            None => y,
            Some(norm) => {
                let [batch, seq, heads, d_head] = y.dims();
                let rows = y.reshape([batch, seq * heads, d_head]);
                let normed = norm.forward(rows, self.fused_qk_norm);
                normed.reshape([batch, seq, heads, d_head])
            }
        };
        let (q, k, v) = (
            per_head(project(&self.q_proj), &self.q_norm),
            per_head(project(&self.k_proj), &self.k_norm),
            project(&self.v_proj),
        );
        let rotary = self
            .rotary
            .as_ref()
            .expect("Llama attention has rotary tables");
        let (q, k) = (
            rotary.apply(q, start, self.fused_rope),
            rotary.apply(k, start, self.fused_rope),
        );
        [q, k, v].map(|t| t.swap_dims(1, 2))
    }
}

/// `[batch, seq, kv_heads, d_head]` → `[batch, seq, kv_heads·g, d_head]`, head `j` repeated `g`
/// times in place (one gather of whole heads).
fn repeat_heads<B: Backend>(x: Tensor<B, 4>, g: usize) -> Tensor<B, 4> {
    if g == 1 {
        return x;
    }
    let heads = x.dims()[2];
    let index: Vec<i64> = (0..heads * g).map(|h| (h / g) as i64).collect();
    let index = Tensor::<B, 1, Int>::from_data(TensorData::new(index, [heads * g]), &x.device());
    x.select(2, index)
}

/// `softmax(QKᵀ/√d_head + M) V` on `[batch, heads, seq, d_head]` tensors, M = −∞ where the key
/// comes after the query, or (with a sliding `window`) `window` or more positions before it; the
/// attention weights' dropout mask is `heads`'s part of the whole model's (see
/// [`dropout_part`]). The decomposed form, for attention with dropout or a window (and for
/// comparison): otherwise the model runs fused attention.
pub fn causal_attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    dropout: &Dropout,
    heads: Option<ActivationPart>,
    window: Option<usize>,
) -> Tensor<B, 4> {
    let [_, _, seq, d_head] = q.dims();
    // Scaling Q (T·d_head entries per head) rather than the scores (T·T) is the same product.
    let scores = (q * (1.0 / (d_head as f64).sqrt())).matmul(k.swap_dims(2, 3));
    let hidden = match window {
        None => Tensor::<B, 2, Bool>::tril_mask([seq, seq], 0, &scores.device()),
        Some(_) => hidden_keys(0..seq, seq, window, &scores.device()),
    };
    let scores = scores.mask_fill(hidden.unsqueeze::<4>(), f32::NEG_INFINITY);
    let weights = in_fp32(scores, |scores| softmax(scores, 3));
    dropout_part(dropout, weights, heads).matmul(v)
}

/// Whether the query at position `query` cannot see the key at position `key`: a later key, or
/// one `window` or more positions back.
pub fn is_hidden(query: usize, key: usize, window: Option<usize>) -> bool {
    key > query || window.is_some_and(|w| query - key >= w)
}

/// `[queries, keys]`, true where the query at each position of `queries` cannot see the key at
/// each position `0..keys` ([`is_hidden`]).
pub fn hidden_keys<B: Backend>(
    queries: std::ops::Range<usize>,
    keys: usize,
    window: Option<usize>,
    device: &B::Device,
) -> Tensor<B, 2, Bool> {
    let rows = queries.len();
    let hidden: Vec<bool> = queries
        .flat_map(|i| (0..keys).map(move |j| is_hidden(i, j, window)))
        .collect();
    Tensor::from_data(TensorData::new(hidden, [rows, keys]), device)
}

impl<B: DecoratedBackend> Mlp<B> {
    pub fn forward(&self, x: Tensor<B, 3>, tp: &TensorParallel<B>) -> Tensor<B, 3> {
        let hidden = match (&self.gate, self.fused) {
            (Some(gate), true) => swiglu(gate.forward(x.clone()), self.c_fc.forward(x)),
            (Some(gate), false) => in_fp32(gate.forward(x.clone()), silu) * self.c_fc.forward(x),
            (None, true) => linear_gelu(&self.c_fc, x),
            (None, false) => gelu_tanh(self.c_fc.forward(x)),
        };
        let y = self.c_proj.forward(hidden);
        let part = tp.sequence_part(y.dims()[SEQUENCE_DIM]);
        dropout_part(&self.dropout, y, part)
    }
}

impl<B: DecoratedBackend> Norm<B> {
    /// The norm computed in fp32 (its fp32 parameters on the input cast up), returned in the
    /// input's type: its mean and variance lose too much in half precision. It runs as the
    /// fused op ([`fused_layer_norm`], [`fused_rms_norm`]) when `fused`, else as Burn's
    /// LayerNorm op or RMSNorm composed of Burn ops.
    pub fn forward(&self, x: Tensor<B, 3>, fused: bool) -> Tensor<B, 3> {
        let (gamma, beta) = (self.gamma.val(), self.beta.as_ref().map(Param::val));
        in_fp32(x, |x| match (self.rms, fused) {
            (true, true) => fused_rms_norm(x, gamma, self.eps),
            (true, false) => {
                let mean_square = x.clone().square().mean_dim(2);
                x / (mean_square + self.eps).sqrt() * gamma.unsqueeze()
            }
            (false, true) => fused_layer_norm(x, gamma, beta, self.eps),
            (false, false) => Tensor::from_primitive(TensorPrimitive::Float(B::layer_norm(
                x.into_primitive().tensor(),
                gamma.into_primitive().tensor(),
                beta.map(|b| b.into_primitive().tensor()),
                self.eps,
            ))),
        })
    }
}

/// SwiGLU's `silu(g) ⊙ u` on the gate and up projections, as the fused op
/// (`wildfire_backend::kernels::swiglu`: one pass each way, computed in fp32 and rounded once)
/// when `fused`, else as Burn ops (`silu` in fp32, the product in the inputs' type).
pub fn gated_silu<B: DecoratedBackend>(
    gate: Tensor<B, 3>,
    up: Tensor<B, 3>,
    fused: bool,
) -> Tensor<B, 3> {
    match fused {
        true => swiglu(gate, up),
        false => in_fp32(gate, silu) * up,
    }
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
            wpe: (config.position_rows() > 0).then(|| {
                EmbeddingConfig::new(config.position_rows(), config.d_model)
                    .with_initializer(normal.clone())
                    .init(device)
            }),
            dropout: dropout(config),
        });
        let rotary = (config.kind == ModelKind::Llama).then(|| {
            let head_dim = config.head_dim();
            let scaling = config.rope_scaling.as_ref();
            Rotary::new(head_dim, config.context, config.rope_theta, scaling)
        });
        let blocks = (stage.first_block..stage.first_block + stage.n_blocks)
            .map(|_| Block::new(config, rotary.as_ref(), device))
            .collect();
        let head = stage.head.then(|| Head {
            ln_f: norm(config, device),
            lm_head: (!config.tie_embeddings)
                .then(|| linear([config.d_model, config.vocab_size], false, INIT_STD, device)),
            wte: None,
            fused_norm: true,
            fused_loss: true,
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

    /// The same model with each fusable op fused or decomposed as `ops` says: the attention
    /// core (see `CausalSelfAttention::fused`; it stays decomposed where the attention weights
    /// have dropout) and Llama's rotary embedding, the MLP's bias + GELU or SwiGLU (see
    /// `Mlp::fused`), the norms, LayerNorm or RMSNorm (see `Block::fused_norm`), and the loss
    /// (see `Head::fused_loss`).
    pub fn with_fused_ops(mut self, ops: FusedOps) -> Self {
        let norm_op = |norm: &Norm<B>| match norm.rms {
            true => FusedOp::RmsNorm,
            false => FusedOp::LayerNorm,
        };
        for block in &mut self.blocks {
            block.attn.fused = ops.is_fused(FusedOp::Attention);
            block.attn.fused_rope = ops.is_fused(FusedOp::Rope);
            let activation = match block.mlp.gate {
                Some(_) => FusedOp::Swiglu,
                None => FusedOp::BiasGelu,
            };
            block.mlp.fused = ops.is_fused(activation);
            block.fused_norm = ops.is_fused(norm_op(&block.ln_1));
            block.attn.fused_qk_norm = ops.is_fused(FusedOp::RmsNorm);
        }
        if let Some(head) = &mut self.head {
            head.fused_norm = ops.is_fused(norm_op(&head.ln_f));
            head.fused_loss = ops.is_fused(FusedOp::CrossEntropy);
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
        self.embed_at(tokens, 0)
    }

    /// [`Self::embed`] of tokens at positions `start..` (generation with a cache).
    pub fn embed_at(&self, tokens: Tensor<B, 2, Int>, start: usize) -> Tensor<B, 3> {
        let embeddings = self
            .embeddings
            .as_ref()
            .expect("embed() on a stage without embeddings");
        let [_, seq] = tokens.dims();
        let device = tokens.device();
        let mut x = embeddings.wte.forward(tokens);
        if let Some(wpe) = &embeddings.wpe {
            let positions = start as i64..(start + seq) as i64;
            x = x + wpe.forward(Tensor::<B, 1, Int>::arange(positions, &device).unsqueeze());
        }
        let x = in_dtype(x, self.precision.compute_dtype());
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
        let head = self.head();
        let x = head.ln_f.forward(x, head.fused_norm);
        if let Some(lm_head) = &head.lm_head {
            return lm_head.forward(x);
        }
        // The head is column-parallel in the vocabulary: its input enters the tensor-parallel
        // region as a column-parallel layer's does.
        let x = self.tp.enter_parallel_region(x);
        let (wte, layout) = self.tied_head(FloatDType::from(x.dtype()));
        layout.logits(x, wte)
    }

    /// The summed next-token cross-entropy of the head on the residual stream `x` against
    /// `targets`: the fused loss ([`Head::fused_loss`]), which scores the head block by block
    /// without the whole logits, or [`Self::loss_sum`] of [`Self::logits`]. Under tensor
    /// parallelism the same value on every rank.
    pub fn head_loss_sum(&self, x: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let head = self.head();
        if !head.fused_loss {
            return self.loss_sum(self.logits(x), targets);
        }
        let x = head.ln_f.forward(x, head.fused_norm);
        let loss = LinearCrossEntropy::new();
        if let Some(lm_head) = &head.lm_head {
            return lm_head.cross_entropy_sum(x, targets, &loss);
        }
        let wte = self.tied_head(FloatDType::from(x.dtype()));
        (self.tp).head_cross_entropy_sum(x, wte, self.vocab, targets, &loss)
    }

    fn head(&self) -> &Head<B> {
        self.head
            .as_ref()
            .expect("the head's output on a stage without the head")
    }

    /// A tied head's weight, `wte` (this rank's rows of it) in `dtype`, and its layout.
    fn tied_head(&self, dtype: FloatDType) -> (Tensor<B, 2>, HeadLayout) {
        let wte = match (&self.head().wte, &self.embeddings) {
            (Some(copy), _) => copy,
            (None, Some(embeddings)) => &embeddings.wte.weight,
            (None, None) => unreachable!("split() gives a tied head without the embedding a copy"),
        };
        (in_dtype(wte.val(), dtype), HeadLayout::VocabRows)
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
                let rows = vocabulary_share(self.vocab, group.rank(), group.size());
                collective(vocab_parallel_cross_entropy(
                    logits,
                    targets,
                    rows.start,
                    IGNORE_INDEX,
                    group,
                ))
            }
        }
    }
}

/// Summed next-token cross-entropy `Σ −log softmax(logits)[target]` over every position (the
/// decomposed loss, from the whole logits; targets equal to `IGNORE_INDEX` add nothing), and
/// the number of positions. Callers divide by the
/// token count of the whole optimizer step, so that gradient accumulation and data parallelism
/// weight every token equally.
pub fn cross_entropy_sum<B: Backend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
) -> (Tensor<B, 1>, usize) {
    let [batch, seq, vocab] = logits.dims();
    let rows = batch * seq;
    let loss = logits_cross_entropy_sum(
        logits.reshape([rows, vocab]),
        targets.reshape([rows]),
        IGNORE_INDEX,
    );
    (loss, rows)
}
