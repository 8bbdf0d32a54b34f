//! Tensor-parallel layers (Megatron-LM): each rank of a tensor-parallel group holds a slice of a
//! layer's weight, and the autodiff-aware collectives of `wildfire_backend::collective` join the
//! slices going forward and backward. With `p` ranks, rank `r` holds part `r` of
//! `split_ranges(n, p)` (the first `n mod p` ranks one row or column more), so sizes that do not
//! divide by `p` work without padding.
//!
//! A layer is built from the serial layer's full weight (`from_full`), so a sharded model's
//! parameters are bitwise the slices of the serial model's for the same seed. With ranks as
//! threads, each rank must pass tensors of its own (e.g. drawn by it, or made from data): clones
//! of one autodiff tensor share its graph node, and ranks whose graphs share a node share one
//! graph lock, which deadlocks their backward collectives.
//!
//! Notation: `Y = XA + b` with `X: [.., n_in]`, `A: [n_in, n_out]` (Burn's `Linear` layout).
//!
//! **Sequence parallelism** (Megatron-LM's SP, for activations `[batch, seq, features]`): between
//! a row-parallel layer and the next column-parallel one (LayerNorm, dropout, residual adds) each
//! rank holds part `r` of the sequence instead of the whole. A column-parallel layer then
//! all-gathers its input along the sequence (backward: reduce-scatter of the gradient) instead
//! of `f`, and a row-parallel layer reduce-scatters its output along the sequence (backward:
//! all-gather) instead of `g`'s all-reduce. The communicated volume is the same (an all-reduce
//! is a reduce-scatter and an all-gather); the activations between the layers shrink `p`-fold.

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use wildfire_backend::collective::{
    self, CollectiveBackend, all_gather_from_sequence_region, copy_to_parallel_region,
    gather_from_parallel_region, reduce_from_parallel_region, reduce_scatter_to_sequence_region,
};
use wildfire_backend::comm::{CommError, ProcessGroup, ReduceOp, split_ranges};

/// `A = [A_1 … A_p]` split by output columns: rank `r` computes `Y_r = X A_r + b_r`. The input
/// goes through `f` (identity forward; the gradient `∂L/∂X = Σ_r ∂L_r/∂X` is all-reduced
/// backward), and the output is either left split (`[.., n_out/p]`, for a following
/// row-parallel layer) or gathered to `[.., n_out]` (`Y = [Y_1 … Y_p]`; backward keeps part
/// `r` of the gradient). Every output element is the serial layer's dot product, so forward and
/// gradients are exactly the serial ones.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    pub group: Option<ProcessGroup>,
    #[module(skip)]
    pub gather_output: bool,
    /// The input is split along the sequence (dimension 1) and gathered here.
    #[module(skip)]
    pub sequence_parallel: bool,
}

/// `A = [A_1; …; A_p]` split by input rows, with `X = [X_1 … X_p]` split alike: rank `r`
/// computes `X_r A_r`, and `Y = Σ_r X_r A_r + b` is all-reduced (`g`: all-reduce forward,
/// identity backward, since every rank then holds the same `∂L/∂Y`). The bias is added once,
/// after the sum. The sum's order differs from the serial dot product's, so outputs agree with
/// the serial layer within rounding (`~ n_in · ε · |x||a|`), not bitwise.
#[derive(Module, Debug)]
pub struct RowParallelLinear<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    pub group: Option<ProcessGroup>,
    /// The output is reduce-scattered along the sequence (dimension 1) instead of all-reduced.
    #[module(skip)]
    pub sequence_parallel: bool,
}

/// An embedding table `E: [V, d]` split by vocabulary rows: rank `r` holds rows `[s_r, e_r)`,
/// looks up the ids in its range (others give zero rows) and the lookups are all-reduced (`g`).
/// Exactly one rank contributes each row, so the sum is exact.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    #[module(skip)]
    pub vocab_start: usize,
    #[module(skip)]
    pub group: Option<ProcessGroup>,
}

fn group_of(group: &Option<ProcessGroup>) -> &ProcessGroup {
    group
        .as_ref()
        .expect("a tensor-parallel layer keeps its group (it was built with one)")
}

/// Part `rank` of `total` along a dimension.
fn part(total: usize, group: &ProcessGroup) -> std::ops::Range<usize> {
    split_ranges(total, group.size())[group.rank()].clone()
}

impl<B: CollectiveBackend> ColumnParallelLinear<B> {
    /// This rank's columns of the serial layer's `weight: [n_in, n_out]` and `bias: [n_out]`,
    /// taken from each of `sections` equal column blocks (3 for a fused QKV projection, so
    /// every rank gets the same heads of Q, K and V; 1 otherwise).
    pub fn from_full(
        weight: Tensor<B, 2>,
        bias: Option<Tensor<B, 1>>,
        sections: usize,
        group: &ProcessGroup,
        gather_output: bool,
    ) -> Self {
        let [n_in, n_out] = weight.dims();
        let width = n_out / sections;
        let columns: Vec<_> = (0..sections)
            .map(|s| {
                let range = part(width, group);
                s * width + range.start..s * width + range.end
            })
            .collect();
        let weight = Tensor::cat(
            columns
                .iter()
                .map(|c| weight.clone().slice([0..n_in, c.clone()]))
                .collect(),
            1,
        );
        let bias = bias.map(|b| {
            Param::from_tensor(Tensor::cat(
                columns.iter().map(|c| b.clone().slice(c.clone())).collect(),
                0,
            ))
        });
        Self {
            weight: Param::from_tensor(weight),
            bias,
            group: Some(group.clone()),
            gather_output,
            sequence_parallel: false,
        }
    }

    /// The same layer taking its input split along the sequence (see the module doc).
    pub fn with_sequence_parallel(self, on: bool) -> Self {
        Self {
            sequence_parallel: on,
            ..self
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, CommError> {
        let group = group_of(&self.group);
        let x = if self.sequence_parallel {
            all_gather_from_sequence_region(x, group, 1)?
        } else {
            copy_to_parallel_region(x, group)?
        };
        let mut y = x.matmul(self.weight.val().unsqueeze());
        if let Some(bias) = &self.bias {
            y = y + bias.val().unsqueeze();
        }
        if self.gather_output {
            y = gather_from_parallel_region(y, group, D - 1)?;
        }
        Ok(y)
    }
}

impl<B: CollectiveBackend> RowParallelLinear<B> {
    /// This rank's rows of the serial layer's `weight: [n_in, n_out]`; the bias whole.
    pub fn from_full(
        weight: Tensor<B, 2>,
        bias: Option<Tensor<B, 1>>,
        group: &ProcessGroup,
    ) -> Self {
        let [n_in, n_out] = weight.dims();
        let rows = part(n_in, group);
        Self {
            weight: Param::from_tensor(weight.slice([rows, 0..n_out])),
            bias: bias.map(Param::from_tensor),
            group: Some(group.clone()),
            sequence_parallel: false,
        }
    }

    /// The same layer leaving its output split along the sequence (see the module doc).
    pub fn with_sequence_parallel(self, on: bool) -> Self {
        Self {
            sequence_parallel: on,
            ..self
        }
    }

    /// `x` is this rank's input columns (`[.., n_in/p]`, e.g. a column-parallel output).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, CommError> {
        let partial = x.matmul(self.weight.val().unsqueeze());
        let group = group_of(&self.group);
        let mut y = if self.sequence_parallel {
            reduce_scatter_to_sequence_region(partial, group, 1)?
        } else {
            reduce_from_parallel_region(partial, group)?
        };
        if let Some(bias) = &self.bias {
            y = y + bias.val().unsqueeze();
        }
        Ok(y)
    }
}

impl<B: CollectiveBackend> VocabParallelEmbedding<B> {
    /// This rank's rows of the serial table `weight: [V, d]`.
    pub fn from_full(weight: Tensor<B, 2>, group: &ProcessGroup) -> Self {
        let [vocab, d] = weight.dims();
        let rows = part(vocab, group);
        Self {
            vocab_start: rows.start,
            weight: Param::from_tensor(weight.slice([rows, 0..d])),
            group: Some(group.clone()),
        }
    }

    /// Rows of `ids: [batch, seq]` → `[batch, seq, d]`.
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Result<Tensor<B, 3>, CommError> {
        let rows = self.weight.val().dims()[0];
        let (local, inside) = local_ids(ids, self.vocab_start, rows);
        let rows = burn::tensor::module::embedding(self.weight.val(), local);
        let masked = rows * inside.unsqueeze_dim::<3>(2);
        reduce_from_parallel_region(masked, group_of(&self.group))
    }
}

/// Ids shifted into a part `[start, start + len)` (others clamped to a valid row) and the float
/// mask of those inside it.
fn local_ids<B: Backend, const D: usize>(
    ids: Tensor<B, D, Int>,
    start: usize,
    len: usize,
) -> (Tensor<B, D, Int>, Tensor<B, D>) {
    let (start, end) = (start as i64, (start + len) as i64);
    let inside = ids
        .clone()
        .greater_equal_elem(start)
        .bool_and(ids.clone().lower_elem(end));
    let local = ids.sub_scalar(start).clamp(0, (len as i64 - 1).max(0));
    (local, inside.float())
}

/// Cross-entropy summed over tokens from vocabulary-parallel logits `logits_r: [batch, seq,
/// V_r]` (rank `r`'s columns `[vocab_start, vocab_start + V_r)` of the full logits), without
/// gathering the full logits:
///
/// ```text
/// m      = max_q max_j l_qj                    all-reduce (max), no gradient (ℓ is shift-invariant)
/// S      = Σ_q Σ_j exp(l_qj − m)               g: all-reduce forward, identity backward
/// l_t    = Σ_q [t ∈ part q] (l_qt − m)          g
/// ℓ      = log S − l_t
/// ```
///
/// Every rank computes the same `ℓ`, and each backpropagates its own copy: through `g` rank `r`
/// gets `∂ℓ/∂l_rj = exp(l_rj − m)/S − [j = t]`, the softmax-minus-one-hot of its own columns,
/// which is the serial gradient's part `r`.
pub fn vocab_parallel_cross_entropy<B: CollectiveBackend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
    vocab_start: usize,
    group: &ProcessGroup,
) -> Result<Tensor<B, 1>, CommError> {
    let [batch, seq, part_vocab] = logits.dims();
    let logits = logits.reshape([batch * seq, part_vocab]);
    let targets = targets.reshape([batch * seq]);
    let local_max = logits.clone().detach().max_dim(1);
    let max = collective::all_reduce(local_max, group, ReduceOp::Max)?;
    let shifted = logits - max;
    let sum_exp = reduce_from_parallel_region(shifted.clone().exp().sum_dim(1), group)?;
    let (local, inside) = local_ids(targets, vocab_start, part_vocab);
    let picked = shifted.gather(1, local.unsqueeze_dim(1)) * inside.unsqueeze_dim(1);
    let target = reduce_from_parallel_region(picked, group)?;
    Ok((sum_exp.log() - target).sum())
}
