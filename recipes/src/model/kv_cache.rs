//! Generation with a key/value cache: each step runs the model on the new tokens only, their
//! queries attending to the keys and values of every earlier position, kept per block.
//!
//! A position's key and value depend only on the tokens up to it (causal attention, and GPT's
//! position embedding or Llama's rotation by absolute position), so the cached ones are those a
//! full forward over the whole sequence would compute; the new queries' scores cover cached and
//! new keys, masked where a key comes after the query. The cache holds at most the model's
//! context: past it, the caller starts again from a window of the latest tokens (see
//! `crate::generate`).

use burn::tensor::activation::softmax;
use burn::tensor::{Int, Tensor};
use wildfire_backend::DecoratedBackend;
use wildfire_backend::kernels::attention::unpack;
use wildfire_parallel::precision::in_fp32;
use wildfire_parallel::tp::TensorParallel;

use super::gpt::hidden_keys;
use super::{Block, CausalSelfAttention, Gpt};

/// Keys and values `[batch, heads, positions, d_head]` of every block, for positions
/// `0..len()`.
#[derive(Debug)]
pub struct KvCache<B: DecoratedBackend> {
    blocks: Vec<Option<[Tensor<B, 4>; 2]>>,
    len: usize,
}

impl<B: DecoratedBackend> KvCache<B> {
    /// An empty cache for `model`'s blocks.
    pub fn new(model: &Gpt<B>) -> Self {
        Self {
            blocks: vec![None; model.blocks.len()],
            len: 0,
        }
    }

    /// Positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<B: DecoratedBackend> Gpt<B> {
    /// Logits `[batch, seq, V]` of `tokens` at positions `cache.len()..`, the earlier positions'
    /// keys and values taken from `cache`, which then holds these positions' too. The whole
    /// model on one rank (no tensor parallelism).
    pub fn forward_cached(
        &self,
        tokens: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let (start, seq) = (cache.len, tokens.dims()[1]);
        let mut x = self.embed_at(tokens, start);
        for (block, kv) in self.blocks.iter().zip(&mut cache.blocks) {
            x = block.forward_cached(x, kv, start, &self.tp);
        }
        cache.len += seq;
        self.logits(x)
    }
}

impl<B: DecoratedBackend> Block<B> {
    fn forward_cached(
        &self,
        x: Tensor<B, 3>,
        kv: &mut Option<[Tensor<B, 4>; 2]>,
        start: usize,
        tp: &TensorParallel<B>,
    ) -> Tensor<B, 3> {
        let ln_1 = self.ln_1.forward(x.clone(), self.fused_norm);
        let x = x + self.attn.forward_cached(ln_1, kv, start);
        let ln_2 = self.ln_2.forward(x.clone(), self.fused_norm);
        x + self.mlp.forward(ln_2, tp)
    }
}

impl<B: DecoratedBackend> CausalSelfAttention<B> {
    fn forward_cached(
        &self,
        x: Tensor<B, 3>,
        kv: &mut Option<[Tensor<B, 4>; 2]>,
        start: usize,
    ) -> Tensor<B, 3> {
        let [q, k, v] = unpack(self.sections(x, start));
        let [batch, heads, seq, d_head] = q.dims();
        let [k, v] = match kv.take() {
            Some([past_k, past_v]) => [
                Tensor::cat(vec![past_k, k], 2),
                Tensor::cat(vec![past_v, v], 2),
            ],
            None => [k, v],
        };
        *kv = Some([k.clone(), v.clone()]);
        let scores = (q * (1.0 / (d_head as f64).sqrt())).matmul(k.swap_dims(2, 3));
        // Query i (position start + i) sees keys 0..=start + i, the last `window` of them.
        let hidden = hidden_keys(
            start..start + seq,
            start + seq,
            self.window,
            &scores.device(),
        );
        let scores = scores.mask_fill(hidden.unsqueeze::<4>(), f32::NEG_INFINITY);
        let weights = in_fp32(scores, |scores| softmax(scores, 3));
        let y = weights
            .matmul(v)
            .swap_dims(1, 2)
            .reshape([batch, seq, heads * d_head]);
        self.c_proj.forward(y)
    }
}
