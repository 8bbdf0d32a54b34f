//! The chunk loop of [`super::LinearCrossEntropy`]: the head's product, the softmax's row
//! statistics and, where asked, the gradients of the loss sum, a block of rows at a time.
//!
//! For a chunk of rows `x_c: [C, d]` with targets `t`, rank `r` of the vocabulary shard's group
//! (the only rank when not sharded) holding columns `[s_r, s_r + V_r)`:
//!
//! ```text
//! l_r  = x_c·W_rᵀ (in x's type, then f32)          [C, V_r]
//! m_r  = max_j l_r,j        S_r = Σ_j exp(l_r,j − m_r)        τ_r = l_r,t−s_r if t ∈ part r, else 0
//! (m_q, S_q, τ_q) all-gathered over the group, then on every rank, in rank order:
//! m    = max_q m_q          S = Σ_q S_q·exp(m_q − m)          τ = Σ_q τ_q  (the target's logit)
//! ℓ    = valid · (log S + m − τ)                              (valid: t ≠ the ignore index)
//! ∂ℓ/∂l_r,j = valid · (exp(l_r,j − m_r)·exp(m_r − m)/S − [j = t − s_r])
//! ∂ℓ/∂x_c  += ∂ℓ/∂l_r · W_r     ∂ℓ/∂W_r += (∂ℓ/∂l_r)ᵀ · x_c    (products in x's type, sums f32)
//! ```
//!
//! The weight's gradient is summed block by block into one f32 tensor; on Flex in f32 each
//! block's product is added in that tensor's memory by the product itself
//! (`kernels::matmul::flex::accumulate`), with no product-sized allocation and no pass to add.
//!
//! One all-gather of `[C, 3]` per chunk is the only communication; every rank folds the same
//! gathered numbers in the same order, so all ranks hold bitwise the same loss. Unsharded the
//! fold is over one rank, `exp(0) = 1` exactly, and the statistics are this rank's own.
//! `∂ℓ/∂x_c` is rank `r`'s part of the input's gradient: the sum over ranks is the caller's
//! (a column-parallel input's `f`, whose backward all-reduces it).

use burn::tensor::{FloatDType, IndexingUpdateOp, Int, Tensor, TensorPrimitive};

use super::{HeadLayout, LinearCrossEntropy, ids_in_part};
use crate::collective::CollectiveBackend;
use crate::comm::CommError;
use crate::kernels::in_dtype;

/// Which gradients the loop computes (those whose inputs require one).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Wants {
    pub hidden: bool,
    pub weight: bool,
}

impl Wants {
    pub const NONE: Wants = Wants {
        hidden: false,
        weight: false,
    };
}

/// What the loop makes: the loss summed over the rows, and the asked-for gradients of that sum
/// in f32: the hidden rows' `[N, d]` (this rank's part under a shard) and the weight's, in the
/// weight's layout.
pub(crate) struct ChunkedLoss<B: CollectiveBackend> {
    pub loss: Tensor<B, 1>,
    pub hidden_grad: Option<Tensor<B, 2>>,
    pub weight_grad: Option<Tensor<B, 2>>,
}

/// The loop over chunks of `hidden: [N, d]` rows (see the module doc), with `weight` in
/// `layout` and `targets: [N]`.
pub(crate) fn run<B: CollectiveBackend>(
    hidden: Tensor<B, 2>,
    weight: Tensor<B, 2>,
    layout: HeadLayout,
    targets: Tensor<B, 1, Int>,
    loss: &LinearCrossEntropy,
    wants: Wants,
) -> Result<ChunkedLoss<B>, CommError> {
    let [rows, width] = hidden.dims();
    let vocab_part = layout.vocab(weight.dims());
    let chunk = loss.rows_per_chunk(vocab_part);
    let device = hidden.device();
    let dtype = FloatDType::from(hidden.dtype());
    let mut total = Tensor::<B, 1>::zeros([1], &device);
    let mut hidden_grads = Vec::new();
    let mut weight_grad = None;
    for start in (0..rows).step_by(chunk) {
        let len = chunk.min(rows - start);
        let x = hidden.clone().narrow(0, start, len);
        let t = targets.clone().narrow(0, start, len);
        let scores = Scores::of(layout.row_logits(x.clone(), weight.clone()), t, loss)?;
        total = total + scores.loss.clone();
        if !(wants.hidden || wants.weight) {
            continue;
        }
        let logits_grad = in_dtype(scores.logits_grad(), dtype);
        if wants.hidden {
            let grad = layout.input_grad(logits_grad.clone(), weight.clone());
            hidden_grads.push(in_dtype(grad, FloatDType::F32));
        }
        if wants.weight {
            weight_grad = Some(match weight_grad {
                Some(sum) => layout.add_weight_grad(sum, logits_grad, x),
                None => in_dtype(layout.weight_grad(logits_grad, x), FloatDType::F32),
            });
        }
    }
    let hidden_grad = wants.hidden.then(|| match hidden_grads.is_empty() {
        true => Tensor::zeros([0, width], &device),
        false => Tensor::cat(hidden_grads, 0),
    });
    let weight_grad = match wants.weight {
        true => Some(weight_grad.unwrap_or_else(|| Tensor::zeros(weight.dims(), &device))),
        false => None,
    };
    Ok(ChunkedLoss {
        loss: total,
        hidden_grad,
        weight_grad,
    })
}

/// A chunk's softmax, as far as its loss and its logits' gradient need it.
struct Scores<B: CollectiveBackend> {
    /// `exp(l_r − m_r)`, `[C, V_r]`.
    exp: Tensor<B, 2>,
    /// `exp(m_r − m)/S`, `[C, 1]`: what turns `exp` into the softmax.
    scale: Tensor<B, 2>,
    /// The targets as columns of this rank's part (clamped into it where outside), `[C, 1]`.
    local_targets: Tensor<B, 2, Int>,
    /// 1 where the target is in this rank's part, `[C, 1]`.
    inside: Tensor<B, 2>,
    /// 1 where the target is not the ignore index, `[C, 1]`.
    valid: Tensor<B, 2>,
    /// `Σ_c ℓ_c`, `[1]`.
    loss: Tensor<B, 1>,
}

impl<B: CollectiveBackend> Scores<B> {
    /// The statistics of `logits: [C, V_r]` (in any float type) against `targets: [C]`, joined
    /// over the shard's group.
    fn of(
        logits: Tensor<B, 2>,
        targets: Tensor<B, 1, Int>,
        loss: &LinearCrossEntropy,
    ) -> Result<Self, CommError> {
        let [rows, vocab_part] = logits.dims();
        let logits = in_dtype(logits, FloatDType::F32);
        let valid = targets.clone().not_equal_elem(loss.ignore_index).float();
        let start = loss.shard.as_ref().map_or(0, |shard| shard.start);
        let (local_targets, inside) = ids_in_part(targets, start, vocab_part);
        let [valid, inside] = [valid, inside].map(|t| t.unsqueeze_dim::<2>(1));
        let local_targets = local_targets.unsqueeze_dim::<2>(1);

        let local_max = logits.clone().max_dim(1);
        let shifted = logits - local_max.clone();
        let picked = shifted.clone().gather(1, local_targets.clone());
        let target_logit = (picked + local_max.clone()) * inside.clone();
        let exp = shifted.exp();
        let local_sum = exp.clone().sum_dim(1);
        let stats = Tensor::cat(vec![local_max.clone(), local_sum, target_logit], 1);
        let stats = match &loss.shard {
            Some(shard) => Tensor::from_primitive(TensorPrimitive::Float(B::comm_all_gather(
                stats.into_primitive().tensor(),
                &shard.group,
                1,
            )?)),
            None => stats,
        };
        let ranks = stats.dims()[1] / 3;
        let stats = stats.reshape([rows, ranks, 3]);
        let part = |k: usize| stats.clone().narrow(2, k, 1);
        let (maxes, sums, target_logits) = (part(0), part(1), part(2));
        let max = maxes.clone().max_dim(1);
        let sum = (sums * (maxes - max.clone()).exp()).sum_dim(1);
        let target = target_logits.sum_dim(1);
        let [max, sum, target] = [max, sum, target].map(|t| t.reshape([rows, 1]));
        let row_loss = (sum.clone().log() + max.clone() - target) * valid.clone();
        Ok(Self {
            exp,
            scale: (local_max - max).exp() / sum,
            local_targets,
            inside,
            valid,
            loss: row_loss.sum(),
        })
    }

    /// `∂(Σ_c ℓ_c)/∂l_r`: the softmax minus the one-hot of the target, zero on ignored rows,
    /// `[C, V_r]` f32.
    fn logits_grad(self) -> Tensor<B, 2> {
        let softmax = self.exp * self.scale;
        let one_hot = self.inside.neg();
        let grad = softmax.scatter(1, self.local_targets, one_hot, IndexingUpdateOp::Add);
        grad * self.valid
    }
}
