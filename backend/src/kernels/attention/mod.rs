//! Fused attention with FlashAttention-2's algorithm: the reference implementation in Burn
//! tensor ops, which runs on every backend, and the autodiff op that routes to the CubeCL
//! kernels ([`cube`]) or Flex's native code ([`flex`]) where they run.
//!
//! For one head, with `Q, K, V: [T, d]`, scale `s = 1/√d` and (causal) `M_ij = −∞` for `j > i`:
//!
//! ```text
//! S = s·QKᵀ + M        P = softmax_rows(S)        O = PV        L_i = log Σ_j exp(S_ij)
//! ```
//!
//! **Forward** over key blocks `K_b, V_b` of `block` rows, keeping per query the running
//! maximum `m`, the running sum `ℓ` and the unnormalised output `A` (the online softmax):
//!
//! ```text
//! S_b = s·Q K_bᵀ + M_b        m' = max(m, rowmax S_b)        P_b = exp(S_b − m')
//! ℓ ← ℓ·exp(m − m') + rowsum P_b        A ← A·exp(m − m') + P_b V_b        m ← m'
//! O = A / ℓ        L = m + log ℓ
//! ```
//!
//! so only a `T × block` tile of scores exists at a time, never `T × T`; `L` (the logsumexp) is
//! all the backward needs besides the inputs and `O`.
//!
//! **Backward**, given `dO`: with `D_i = Σ_k dO_ik O_ik` (= Σ_j P_ij dP_ij), per key block,
//! recomputing the tile's probabilities from `L`:
//!
//! ```text
//! P_b = exp(S_b − L)        dV_b = P_bᵀ dO        dP_b = dO V_bᵀ        dS_b = P_b ∘ (dP_b − D)
//! dQ += s·dS_b K_b          dK_b = s·dS_bᵀ Q
//! ```
//!
//! Tensors are `[batch, heads, seq, d_head]`; the logsumexp is `[batch, heads, seq]`. Inputs in
//! f16 or bf16 are computed in f32 and the results returned in the input type.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, DType, FloatDType, Shape, Tensor, TensorMetadata};

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

use super::cube_kernel::{CubeKernel, TensorSpec};
use super::route::{on_cube, on_flex, took_reference};
use super::{in_dtype, tensor};
use crate::Parallel;

pub mod cube;
pub mod flex;

/// The key-block size of the reference: the tile of scores is `seq × REFERENCE_BLOCK`.
pub const REFERENCE_BLOCK: usize = 64;

/// What an attention forward returns: the output, and the logsumexp of each query's scores
/// (what the backward recomputes the probabilities from).
#[derive(Debug, Clone)]
pub struct AttentionForward<B: Backend> {
    /// `[batch, heads, seq, d_head]`, in the inputs' type.
    pub output: Tensor<B, 4>,
    /// `[batch, heads, seq]`, in f32.
    pub logsumexp: Tensor<B, 3>,
}

/// The gradients of the three inputs, in the inputs' type.
#[derive(Debug, Clone)]
pub struct AttentionGrads<B: Backend> {
    pub query: Tensor<B, 4>,
    pub key: Tensor<B, 4>,
    pub value: Tensor<B, 4>,
}

fn f32<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Tensor<B, D> {
    in_dtype(tensor, FloatDType::F32)
}

/// The scores of all queries against keys `keys` (a range of key positions), scaled, with the
/// causal mask applied: `[batch, heads, seq, keys.len()]`.
fn score_tile<B: Backend>(
    query: &Tensor<B, 4>,
    key: &Tensor<B, 4>,
    keys: std::ops::Range<usize>,
    scale: f64,
    causal: bool,
) -> Tensor<B, 4> {
    let [_, _, seq, _] = query.dims();
    let key_block = key.clone().narrow(2, keys.start, keys.len());
    let scores = query.clone().matmul(key_block.swap_dims(2, 3)) * scale;
    if !causal {
        return scores;
    }
    // Key j is hidden from query i when j > i: the columns of the full causal mask for `keys`.
    let hidden = Tensor::<B, 2, Bool>::tril_mask([seq, seq], 0, &scores.device()).narrow(
        1,
        keys.start,
        keys.len(),
    );
    scores.mask_fill(hidden.unsqueeze::<4>(), f32::NEG_INFINITY)
}

fn key_blocks(seq: usize, block: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..seq)
        .step_by(block)
        .map(move |start| start..(start + block).min(seq))
}

/// The forward (see the module doc) with key blocks of `block` rows.
pub fn attention_forward<B: Backend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    causal: bool,
    block: usize,
) -> AttentionForward<B> {
    let dtype = FloatDType::from(query.dtype());
    let (query, key, value) = (f32(query), f32(key), f32(value));
    let [batch, heads, seq, d_head] = query.dims();
    let device = query.device();
    let scale = 1.0 / (d_head as f64).sqrt();
    let mut max = Tensor::<B, 3>::full([batch, heads, seq], f32::NEG_INFINITY, &device);
    let mut sum = Tensor::<B, 3>::zeros([batch, heads, seq], &device);
    let mut acc = Tensor::<B, 4>::zeros([batch, heads, seq, d_head], &device);
    for keys in key_blocks(seq, block) {
        let scores = score_tile(&query, &key, keys.clone(), scale, causal);
        let new_max = max
            .clone()
            .max_pair(scores.clone().max_dim(3).squeeze_dim(3));
        // Every query sees key 0, in the first block: from there on m is finite, so a block a
        // causal query cannot see gives exp(−∞ − m) = 0, and the first block's correction is
        // exp(−∞) = 0, never NaN.
        let correction = (max - new_max.clone()).exp();
        let probs = (scores - new_max.clone().unsqueeze_dim(3)).exp();
        sum = sum * correction.clone() + probs.clone().sum_dim(3).squeeze_dim(3);
        let value_block = value.clone().narrow(2, keys.start, keys.len());
        acc = acc * correction.unsqueeze_dim(3) + probs.matmul(value_block);
        max = new_max;
    }
    let output = acc / sum.clone().unsqueeze_dim(3);
    AttentionForward {
        output: in_dtype(output, dtype),
        logsumexp: max + sum.log(),
    }
}

/// The backward (see the module doc) with key blocks of `block` rows, from the forward's
/// `output` and `logsumexp` and the output's gradient.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<B: Backend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    output: Tensor<B, 4>,
    logsumexp: Tensor<B, 3>,
    output_grad: Tensor<B, 4>,
    causal: bool,
    block: usize,
) -> AttentionGrads<B> {
    let dtype = FloatDType::from(query.dtype());
    let (query, key, value) = (f32(query), f32(key), f32(value));
    let (output, output_grad) = (f32(output), f32(output_grad));
    let [_, _, seq, d_head] = query.dims();
    let scale = 1.0 / (d_head as f64).sqrt();
    let row_dot = (output_grad.clone() * output).sum_dim(3);
    let logsumexp = logsumexp.unsqueeze_dim(3);
    let mut query_grad = query.zeros_like();
    let (mut key_grads, mut value_grads) = (Vec::new(), Vec::new());
    for keys in key_blocks(seq, block) {
        let scores = score_tile(&query, &key, keys.clone(), scale, causal);
        let probs = (scores - logsumexp.clone()).exp();
        let key_block = key.clone().narrow(2, keys.start, keys.len());
        let value_block = value.clone().narrow(2, keys.start, keys.len());
        value_grads.push(probs.clone().swap_dims(2, 3).matmul(output_grad.clone()));
        let prob_grads = output_grad.clone().matmul(value_block.swap_dims(2, 3));
        let score_grads = probs * (prob_grads - row_dot.clone());
        query_grad = query_grad + score_grads.clone().matmul(key_block) * scale;
        key_grads.push(score_grads.swap_dims(2, 3).matmul(query.clone()) * scale);
    }
    AttentionGrads {
        query: in_dtype(query_grad, dtype),
        key: in_dtype(Tensor::cat(key_grads, 2), dtype),
        value: in_dtype(Tensor::cat(value_grads, 2), dtype),
    }
}

/// Decomposed attention, `softmax(s·QKᵀ + M)V` in the inputs' type with the whole `T × T`
/// score matrix: what Burn's autodiff records without a fused kernel. The kernels and the
/// reference are checked against it, and the benchmarks compare with it.
pub fn decomposed_attention<B: Backend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    causal: bool,
) -> Tensor<B, 4> {
    let [_, _, seq, d_head] = query.dims();
    let scores = query.matmul(key.swap_dims(2, 3)) * (1.0 / (d_head as f64).sqrt());
    let scores = match causal {
        true => {
            let future = Tensor::<B, 2, Bool>::tril_mask([seq, seq], 0, &scores.device());
            scores.mask_fill(future.unsqueeze::<4>(), f32::NEG_INFINITY)
        }
        false => scores,
    };
    softmax(scores, 3).matmul(value)
}

/// A backend with fused attention: `softmax(QKᵀ/√d_head + M) V` on `[batch, heads, seq,
/// d_head]` queries (M the causal mask when `causal`), whose autodiff backward is the fused one
/// (recomputing the probabilities from the saved logsumexp) rather than the decomposed graph.
/// Keys and values are `[batch, kv_heads, seq, d_head]` with `kv_heads` dividing `heads`
/// (grouped-query attention: query head `h` attends with key/value head `h / (heads /
/// kv_heads)`); the gradients of a shared key/value head are summed over its query heads.
pub trait FusedAttentionBackend: Backend {
    fn fused_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        causal: bool,
    ) -> FloatTensor<Self>;

    /// The same on Q, K and V packed in one projection, `qkv: [batch, seq, 3·heads, d_head]`
    /// (see [`unpack`]): one op with one input, so its backward hands `qkv` one gradient in the
    /// packed layout, where three views of it would each give a zero-filled full-size gradient
    /// to be summed.
    fn fused_qkv_attention(qkv: FloatTensor<Self>, causal: bool) -> FloatTensor<Self>;
}

/// Fused attention on `Tensor`s (see [`FusedAttentionBackend`]), grouped-query where the keys
/// and values have fewer heads than the queries.
///
/// # Panics
/// When the key or value is not the query's shape but for a number of heads dividing the
/// query's.
pub fn fused_attention<B: FusedAttentionBackend>(
    query: Tensor<B, 4>,
    key: Tensor<B, 4>,
    value: Tensor<B, 4>,
    causal: bool,
) -> Tensor<B, 4> {
    let (q, k, v) = (query.dims(), key.dims(), value.dims());
    let grouped = k == v
        && k[1] > 0
        && q[1].is_multiple_of(k[1])
        && [0, 2, 3].into_iter().all(|dim| k[dim] == q[dim]);
    assert!(
        grouped,
        "fused_attention: query {q:?}, key {k:?} and value {v:?} must agree but for the key and \
         value's heads (dim 1), which must be equal and divide the query's"
    );
    tensor(B::fused_attention(
        primitive(query),
        primitive(key),
        primitive(value),
        causal,
    ))
}

/// Fused self-attention on a packed projection `qkv: [batch, seq, 3·heads, d_head]` (a GPT's
/// QKV projection reshaped; see [`unpack`]): `[batch, heads, seq, d_head]`, the same values as
/// [`fused_attention`] on the three views, with one gradient for `qkv`.
///
/// # Panics
/// When `qkv`'s third dimension is not a multiple of 3.
pub fn fused_qkv_attention<B: FusedAttentionBackend>(
    qkv: Tensor<B, 4>,
    causal: bool,
) -> Tensor<B, 4> {
    let dims = qkv.dims();
    assert!(
        dims[2].is_multiple_of(3),
        "fused_qkv_attention: qkv of shape {dims:?} has {} heads in its third dimension, not \
         3 equal sections (Q, K, V)",
        dims[2]
    );
    tensor(B::fused_qkv_attention(primitive(qkv), causal))
}

/// Q, K and V as views of a packed projection `qkv: [batch, seq, 3·heads, d_head]` whose third
/// dimension holds Q's heads, then K's, then V's: each `[batch, heads, seq, d_head]`, no data
/// moved.
pub fn unpack<B: Backend>(qkv: Tensor<B, 4>) -> [Tensor<B, 4>; 3] {
    let heads = qkv.dims()[2] / 3;
    [0, 1, 2].map(|section| {
        qkv.clone()
            .narrow(2, section * heads, heads)
            .swap_dims(1, 2)
    })
}

/// The inverse of [`unpack`]: Q's, K's and V's `[batch, heads, seq, d_head]` (their gradients)
/// in one `[batch, seq, 3·heads, d_head]`; on Flex one pass of row copies ([`flex::pack_heads`];
/// Flex's `cat` would first copy each transposed section, element by element).
pub fn pack<B: Backend>(sections: [Tensor<B, 4>; 3]) -> Tensor<B, 4> {
    match on_flex(PACK, sections.map(primitive), flex::pack_heads) {
        Ok([packed]) => tensor(packed),
        Err(sections) => {
            let sections = sections.map(|section| tensor::<B, 4>(section).swap_dims(1, 2));
            Tensor::cat(sections.to_vec(), 2)
        }
    }
}

/// The ops' names in the log and the kernel paths' counts ([`super::route::kernel_paths`]).
/// Packing has no kernel but Flex's loops: elsewhere it is Burn ops by design, not counted.
const FORWARD: &str = "attention forward";
const BACKWARD: &str = "attention backward";
const PACK: &str = "attention gradient pack";

/// A rank-4 float `Tensor`'s primitive.
fn primitive<B: Backend>(tensor: Tensor<B, 4>) -> FloatTensor<B> {
    tensor.into_primitive().tensor()
}

/// FlashAttention-2's forward kernel ([`cube::forward`]).
#[derive(Clone, Debug)]
struct FlashForward {
    causal: bool,
}

impl CubeKernel<3, 2> for FlashForward {
    fn op(&self) -> &'static str {
        FORWARD
    }

    fn outputs<R: CubeRuntime>(
        &self,
        inputs: &[TensorSpec; 3],
        device: &R::Device,
    ) -> Result<[TensorSpec; 2], String> {
        if let Some(reason) = cube::unsupported::<R>(inputs, device) {
            return Err(reason);
        }
        let query = inputs[0].clone();
        let [batch, heads, seq, _] = query.shape.dims::<4>();
        let logsumexp = TensorSpec::new(Shape::new([batch, heads, seq]), DType::F32);
        Ok([query, logsumexp])
    }

    fn launch<R: CubeRuntime>(
        &self,
        [query, key, value]: [CubeTensor<R>; 3],
    ) -> [CubeTensor<R>; 2] {
        let (output, logsumexp) = cube::forward(query, key, value, self.causal);
        [output, logsumexp]
    }
}

/// FlashAttention-2's backward kernels ([`cube::backward`]).
#[derive(Clone, Debug)]
struct FlashBackward {
    causal: bool,
}

impl CubeKernel<6, 3> for FlashBackward {
    fn op(&self) -> &'static str {
        BACKWARD
    }

    fn outputs<R: CubeRuntime>(
        &self,
        inputs: &[TensorSpec; 6],
        device: &R::Device,
    ) -> Result<[TensorSpec; 3], String> {
        if let Some(reason) = cube::unsupported::<R>(inputs, device) {
            return Err(reason);
        }
        let [query, .., output_grad] = inputs;
        if output_grad.shape != query.shape {
            return Err(format!(
                "output gradient {:?} for query {:?}",
                output_grad.shape, query.shape
            ));
        }
        Ok([(); 3].map(|_| query.clone()))
    }

    fn launch<R: CubeRuntime>(&self, inputs: [CubeTensor<R>; 6]) -> [CubeTensor<R>; 3] {
        cube::backward(inputs, self.causal)
    }
}

/// The forward on backend `B`: Flex's native loops (unless opted out), which read grouped
/// key/value heads where they lie; elsewhere, with the key/value heads repeated for their
/// query heads ([`repeat_heads`]), the CubeCL kernel on CubeCL backends ([`super::route`]) and
/// the reference otherwise.
fn forward_on<B: Backend>(
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    causal: bool,
) -> AttentionForward<B> {
    let routed = on_flex(FORWARD, [query, key, value], |inputs| {
        flex::attention_forward(inputs, causal)
    })
    .or_else(|[query, key, value]| {
        let group = group_size::<B>(&query, &key);
        let [key, value] = [key, value].map(|kv| repeat_heads::<B>(kv, group));
        on_cube(&FlashForward { causal }, [query, key, value])
    });
    match routed {
        Ok([output, logsumexp]) => AttentionForward {
            output: tensor(output),
            logsumexp: tensor(logsumexp),
        },
        Err([query, key, value]) => {
            took_reference(FORWARD);
            attention_forward(
                tensor(query),
                tensor(key),
                tensor(value),
                causal,
                REFERENCE_BLOCK,
            )
        }
    }
}

/// The backward on backend `B` from `[query, key, value, output, logsumexp, output_grad]`,
/// routed as [`forward_on`]; where the key/value heads were repeated, the gradients of each
/// repetition summed into their head ([`sum_repeated_heads`]).
fn backward_on<B: Backend>(inputs: [FloatTensor<B>; 6], causal: bool) -> AttentionGrads<B> {
    let routed = on_flex(BACKWARD, inputs, |inputs| {
        flex::attention_backward(inputs, causal)
    });
    let [query, key, value, output, logsumexp, output_grad] = match routed {
        Ok([query, key, value]) => {
            return AttentionGrads {
                query: tensor(query),
                key: tensor(key),
                value: tensor(value),
            };
        }
        Err(inputs) => inputs,
    };
    let group = group_size::<B>(&query, &key);
    let [key, value] = [key, value].map(|kv| repeat_heads::<B>(kv, group));
    let inputs = [query, key, value, output, logsumexp, output_grad];
    let grads = match on_cube(&FlashBackward { causal }, inputs) {
        Ok([query, key, value]) => AttentionGrads {
            query: tensor(query),
            key: tensor(key),
            value: tensor(value),
        },
        Err([query, key, value, output, logsumexp, output_grad]) => {
            took_reference(BACKWARD);
            attention_backward(
                tensor(query),
                tensor(key),
                tensor(value),
                tensor(output),
                tensor(logsumexp),
                tensor(output_grad),
                causal,
                REFERENCE_BLOCK,
            )
        }
    };
    AttentionGrads {
        key: sum_repeated_heads(grads.key, group),
        value: sum_repeated_heads(grads.value, group),
        ..grads
    }
}

/// Query heads per key/value head: `heads / kv_heads` of `query: [batch, heads, seq, d]` and
/// `key: [batch, kv_heads, seq, d]`.
fn group_size<B: Backend>(query: &FloatTensor<B>, key: &FloatTensor<B>) -> usize {
    query.shape()[1] / key.shape()[1]
}

/// `[batch, kv_heads, seq, d]` → `[batch, kv_heads·g, seq, d]`, head `j` repeated `g` times in
/// place: grouped-query attention as attention with as many key/value heads as query heads.
fn repeat_heads<B: Backend>(kv: FloatTensor<B>, g: usize) -> FloatTensor<B> {
    if g == 1 {
        return kv;
    }
    let kv = tensor::<B, 4>(kv);
    let [batch, kv_heads, seq, d] = kv.dims();
    let repeated = kv
        .unsqueeze_dim::<5>(2)
        .expand([batch, kv_heads, g, seq, d]);
    primitive(repeated.reshape([batch, kv_heads * g, seq, d]))
}

/// The adjoint of [`repeat_heads`]: `[batch, kv_heads·g, seq, d]` → `[batch, kv_heads, seq, d]`,
/// each head the sum of its `g` repetitions.
fn sum_repeated_heads<B: Backend>(grad: Tensor<B, 4>, g: usize) -> Tensor<B, 4> {
    if g == 1 {
        return grad;
    }
    let [batch, heads, seq, d] = grad.dims();
    grad.reshape([batch, heads / g, g, seq, d])
        .sum_dim(2)
        .reshape([batch, heads / g, seq, d])
}

impl<B: Backend> FusedAttentionBackend for Parallel<B> {
    fn fused_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        causal: bool,
    ) -> FloatTensor<Self> {
        primitive(forward_on::<Self>(query, key, value, causal).output)
    }

    fn fused_qkv_attention(qkv: FloatTensor<Self>, causal: bool) -> FloatTensor<Self> {
        let [query, key, value] = FusedAttentionBackward::<1>::views::<Self>([qkv]);
        Self::fused_attention(query, key, value, causal)
    }
}

/// The autodiff node of fused attention with `N` inputs: Q, K and V apart (`N = 3`) or packed
/// in one projection (`N = 1`). Its backward is the fused one ([`backward_on`]).
#[derive(Debug)]
struct FusedAttentionBackward<const N: usize> {
    causal: bool,
}

/// How an attention op's `N` inputs hold Q, K and V, and how the inputs' gradients are made of
/// Q's, K's and V's.
trait AttentionInputs<const N: usize> {
    fn views<B: Backend>(inputs: [FloatTensor<B>; N]) -> [FloatTensor<B>; 3];
    fn grads<B: Backend>(grads: AttentionGrads<B>) -> [FloatTensor<B>; N];
}

impl AttentionInputs<3> for FusedAttentionBackward<3> {
    fn views<B: Backend>(inputs: [FloatTensor<B>; 3]) -> [FloatTensor<B>; 3] {
        inputs
    }

    fn grads<B: Backend>(grads: AttentionGrads<B>) -> [FloatTensor<B>; 3] {
        [grads.query, grads.key, grads.value].map(primitive)
    }
}

impl AttentionInputs<1> for FusedAttentionBackward<1> {
    fn views<B: Backend>([qkv]: [FloatTensor<B>; 1]) -> [FloatTensor<B>; 3] {
        unpack(tensor::<B, 4>(qkv)).map(primitive)
    }

    fn grads<B: Backend>(grads: AttentionGrads<B>) -> [FloatTensor<B>; 1] {
        [primitive(pack([grads.query, grads.key, grads.value]))]
    }
}

/// What the backward keeps: the inputs, the output and the logsumexp.
type SavedAttention<B, const N: usize> = ([FloatTensor<B>; N], FloatTensor<B>, FloatTensor<B>);

impl<B: Backend, const N: usize> Backward<Parallel<B>, N> for FusedAttentionBackward<N>
where
    Self: AttentionInputs<N>,
{
    type State = SavedAttention<Parallel<B>, N>;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let output_grad = grads.consume::<Parallel<B>>(&ops.node);
        let (inputs, output, logsumexp) = ops.state;
        let [query, key, value] = Self::views::<Parallel<B>>(inputs);
        let input_grads = backward_on::<Parallel<B>>(
            [query, key, value, output, logsumexp, output_grad],
            self.causal,
        );
        for (node, grad) in ops
            .parents
            .into_iter()
            .zip(Self::grads::<Parallel<B>>(input_grads))
        {
            if let Some(node) = node {
                grads.register::<Parallel<B>>(node.id, grad);
            }
        }
    }
}

impl<const N: usize> FusedAttentionBackward<N>
where
    Self: AttentionInputs<N>,
{
    /// The forward on `inputs`, recorded as this node (keeping what its backward needs when
    /// the graph is tracked).
    fn record<B: Backend, C: CheckpointStrategy>(
        self,
        inputs: [FloatTensor<Autodiff<Parallel<B>, C>>; N],
    ) -> FloatTensor<Autodiff<Parallel<B>, C>> {
        let nodes = inputs.each_ref().map(|input| input.node.clone());
        let inputs = inputs.map(|input| input.primitive);
        let [query, key, value] = Self::views::<Parallel<B>>(inputs.clone());
        let forward = forward_on::<Parallel<B>>(query, key, value, self.causal);
        let output = primitive(forward.output);
        match self.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let logsumexp = forward.logsumexp.into_primitive().tensor();
                prep.finish((inputs, output.clone(), logsumexp), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> FusedAttentionBackend for Autodiff<Parallel<B>, C> {
    fn fused_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        causal: bool,
    ) -> FloatTensor<Self> {
        FusedAttentionBackward::<3> { causal }.record::<B, C>([query, key, value])
    }

    fn fused_qkv_attention(qkv: FloatTensor<Self>, causal: bool) -> FloatTensor<Self> {
        FusedAttentionBackward::<1> { causal }.record::<B, C>([qkv])
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::{DType, Distribution};

    use super::*;

    type B = Flex;
    type A = Autodiff<Flex>;

    fn max_difference(a: Tensor<B, 4>, b: Tensor<B, 4>) -> f32 {
        let a: Vec<f32> = a.into_data().to_vec().unwrap();
        let b: Vec<f32> = b.into_data().to_vec().unwrap();
        crate::compare::max_abs_difference(&a, &b) as f32
    }

    /// Forward and the three input gradients against decomposed attention with autodiff, for
    /// lengths that are and are not multiples of the key block (1, 17, 128, 257) and head
    /// dimensions 32, 64 and 128, causal and not. f32 tolerance: 2e-5 absolute on values of
    /// order 1 (the two orders of summation differ by a few ulps per term over up to 257 terms).
    #[test]
    fn the_reference_matches_decomposed_attention() {
        let device = Default::default();
        for (seq, d_head) in [(1, 32), (17, 64), (128, 128), (257, 32), (257, 64)] {
            for causal in [true, false] {
                B::seed(&device, seq as u64);
                let shape = [2, 2, seq, d_head];
                let draw =
                    || Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
                let (q, k, v, grad) = (draw(), draw(), draw(), draw());
                let leaf = |t: &Tensor<B, 4>| Tensor::<A, 4>::from_inner(t.clone()).require_grad();
                let (qa, ka, va) = (leaf(&q), leaf(&k), leaf(&v));
                let expected = decomposed_attention(qa.clone(), ka.clone(), va.clone(), causal);
                let grads = (expected.clone() * Tensor::from_inner(grad.clone()))
                    .sum()
                    .backward();
                let forward = attention_forward(q.clone(), k.clone(), v.clone(), causal, 64);
                let what = format!("seq {seq}, d_head {d_head}, causal {causal}");
                let output_error = max_difference(forward.output.clone(), expected.inner());
                assert!(output_error < 2e-5, "{what}: output off by {output_error}");
                let backward = attention_backward(
                    q,
                    k,
                    v,
                    forward.output,
                    forward.logsumexp,
                    grad,
                    causal,
                    64,
                );
                for (name, got, leaf) in [
                    ("dQ", backward.query, &qa),
                    ("dK", backward.key, &ka),
                    ("dV", backward.value, &va),
                ] {
                    let error = max_difference(got, leaf.grad(&grads).unwrap());
                    assert!(error < 2e-5, "{what}: {name} off by {error}");
                }
            }
        }
    }

    /// bf16 and f16 inputs come back in their type, and equal the f32 computation on the same
    /// (rounded) inputs up to the output's rounding: the unit roundoff, 2^-8 relative for bf16
    /// (8 significant bits) and 2^-11 for f16 (11 bits), or for an f16 subnormal half its fixed
    /// spacing.
    #[test]
    fn half_precision_inputs_compute_in_f32() {
        let device = Default::default();
        let shape = [1, 2, 33, 32];
        let draw = || Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let (q, k, v) = (draw(), draw(), draw());
        // (type, unit roundoff, half the spacing of its subnormals: below the smallest normal
        // a value is rounded to a fixed absolute step, 2^-24 in f16).
        for (dtype, relative, absolute) in [
            (FloatDType::BF16, 2f32.powi(-8), 0.0),
            (FloatDType::F16, 2f32.powi(-11), 2f32.powi(-25)),
        ] {
            let half = |t: &Tensor<B, 4>| t.clone().cast(dtype);
            let forward = attention_forward(half(&q), half(&k), half(&v), true, 16);
            assert_eq!(forward.output.dtype(), DType::from(dtype));
            assert_eq!(forward.logsumexp.dtype(), DType::F32);
            let widened = |t: &Tensor<B, 4>| half(t).cast(FloatDType::F32);
            let exact = attention_forward(widened(&q), widened(&k), widened(&v), true, 16).output;
            let got: Vec<f32> = forward
                .output
                .cast(FloatDType::F32)
                .into_data()
                .to_vec()
                .unwrap();
            let exact: Vec<f32> = exact.into_data().to_vec().unwrap();
            for (g, e) in got.iter().zip(&exact) {
                assert!(
                    (g - e).abs() <= relative * e.abs() + absolute,
                    "{dtype:?}: {g} for {e}"
                );
            }
        }
    }

    /// Through `Autodiff<Parallel<Flex>>`, fused attention's forward and gradients match the
    /// decomposed graph's (same tolerance as the reference's test), and the gradient of an
    /// input that does not need one is not computed.
    #[test]
    fn the_autodiff_op_runs_the_fused_backward() {
        type P = Autodiff<crate::Parallel<Flex>>;
        let device = Default::default();
        let shape = [1, 3, 70, 32];
        let draw = || Tensor::<P, 4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let (q, k, v, g) = (draw(), draw(), draw(), draw().detach());
        let leaves = || {
            (
                q.clone().require_grad(),
                k.clone().require_grad(),
                v.clone(),
            )
        };
        let (qf, kf, vf) = leaves();
        let fused = fused_attention(qf.clone(), kf.clone(), vf.clone(), true);
        let fused_grads = (fused.clone() * g.clone()).sum().backward();
        let (qd, kd, vd) = leaves();
        let [_, _, seq, d_head] = shape;
        let scores = qd.clone().matmul(kd.clone().swap_dims(2, 3)) * (1.0 / (d_head as f64).sqrt());
        let future = Tensor::<P, 2, Bool>::tril_mask([seq, seq], 0, &device);
        let weights = softmax(
            scores.mask_fill(future.unsqueeze::<4>(), f32::NEG_INFINITY),
            3,
        );
        let decomposed = weights.matmul(vd.clone());
        let decomposed_grads = (decomposed.clone() * g).sum().backward();
        let inner = |t: Tensor<P, 4>| Tensor::<B, 4>::from_data(t.inner().into_data(), &device);
        assert!(max_difference(inner(fused), inner(decomposed)) < 2e-5);
        for (name, a, b) in [("dQ", &qf, &qd), ("dK", &kf, &kd)] {
            let (a, b) = (
                a.grad(&fused_grads).unwrap(),
                b.grad(&decomposed_grads).unwrap(),
            );
            let error = max_difference(
                Tensor::from_data(a.into_data(), &device),
                Tensor::from_data(b.into_data(), &device),
            );
            assert!(error < 2e-5, "{name} off by {error}");
        }
        assert!(vf.grad(&fused_grads).is_none(), "V needs no gradient");
    }

    /// The packed op is the same computation on views: through `Autodiff<Parallel<Flex>>` its
    /// output and its one `qkv` gradient equal (exactly) those of `fused_attention` on
    /// [`unpack`]'s three views, whose gradients the graph sums into `qkv`'s.
    #[test]
    fn packed_qkv_attention_equals_attention_on_its_views() {
        type P = Autodiff<crate::Parallel<Flex>>;
        let device = Default::default();
        let qkv =
            Tensor::<P, 4>::random([2, 37, 3 * 2, 16], Distribution::Normal(0.0, 1.0), &device);
        let g = Tensor::<P, 4>::random([2, 2, 37, 16], Distribution::Normal(0.0, 1.0), &device);
        let values = |t: Tensor<P, 4>| t.into_data().to_vec::<f32>().unwrap();
        let run = |packed: bool| {
            let qkv = qkv.clone().require_grad();
            let output = match packed {
                true => fused_qkv_attention(qkv.clone(), true),
                false => {
                    let [q, k, v] = unpack(qkv.clone());
                    fused_attention(q, k, v, true)
                }
            };
            let grads = (output.clone() * g.clone()).sum().backward();
            let grad = Tensor::<P, 4>::from_inner(qkv.grad(&grads).unwrap());
            (values(output), values(grad))
        };
        let (packed, views) = (run(true), run(false));
        assert!(packed.0 == views.0, "outputs differ");
        assert!(packed.1 == views.1, "qkv gradients differ");
    }

    /// `pack` (on Flex, its native row copies) equals the concatenation in tensor ops it stands
    /// for, on contiguous and on transposed sections, and `unpack` takes it apart again.
    #[test]
    fn pack_is_the_concatenation_of_the_transposed_sections() {
        let device = Default::default();
        let draw = || Tensor::<B, 4>::random([2, 3, 5, 4], Distribution::Default, &device);
        let transposed = Tensor::<B, 4>::random([2, 3, 4, 5], Distribution::Default, &device);
        let sections = [draw(), transposed.swap_dims(2, 3), draw()];
        let concatenated = Tensor::cat(sections.clone().map(|s| s.swap_dims(1, 2)).to_vec(), 2);
        let packed = pack(sections.clone());
        assert_eq!(packed.dims(), [2, 5, 9, 4]);
        assert_eq!(packed.to_data(), concatenated.into_data());
        for (section, unpacked) in sections.into_iter().zip(unpack(packed)) {
            assert_eq!(unpacked.into_data(), section.into_data());
        }
    }

    #[test]
    #[should_panic(expected = "qkv of shape [1, 4, 5, 8] has 5 heads")]
    fn packed_qkv_attention_names_a_width_that_is_not_three_sections() {
        let qkv = Tensor::<crate::Parallel<Flex>, 4>::zeros([1, 4, 5, 8], &Default::default());
        let _ = fused_qkv_attention(qkv, true);
    }
}
