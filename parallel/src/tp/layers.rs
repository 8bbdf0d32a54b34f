//! The parallel-aware layers: [`ParallelLinear`] and [`ParallelEmbedding`] compute exactly what
//! Burn's `Linear` and `Embedding` compute until a plan splits them ([`super::apply_plan`]);
//! then each rank holds a slice of the weight, and the autodiff-aware collectives of
//! `wildfire_backend::collective` join the slices going forward and backward (Megatron-LM).
//!
//! Notation: `Y = XA + b` with `X: [.., n_in]`, `A: [n_in, n_out]` (Burn's `Linear` layout), `p`
//! ranks. The product runs in `X`'s type: fp32 weights meet bf16 or fp16 activations cast to them
//! (see [`crate::precision`]).
//!
//! - **Column-parallel** (`A = [A_1 … A_p]` by output columns): rank `r` computes
//!   `Y_r = X A_r + b_r`. The input goes through `f` (identity forward; the gradient
//!   `∂L/∂X = Σ_r ∂L_r/∂X` is all-reduced backward); the output stays split (`[.., n_out/p]`,
//!   for a following row-parallel layer) or is gathered (`Y = [Y_1 … Y_p]`; backward keeps part
//!   `r` of the gradient). Every output element is the serial layer's dot product, so forward
//!   and gradients are exactly the serial ones.
//! - **Row-parallel** (`A = [A_1; …; A_p]` by input rows, `X = [X_1 … X_p]` alike): rank `r`
//!   computes `X_r A_r`, and `Y = Σ_r X_r A_r + b` is all-reduced (`g`: all-reduce forward,
//!   identity backward, since every rank then holds the same `∂L/∂Y`). The bias is added once,
//!   after the sum. The sum's order differs from the serial dot product's, so outputs agree
//!   with the serial layer within rounding (`~ n_in · ε · |x||a|`), not bitwise.
//! - **Column-parallel by heads, fewer heads than ranks** ([`TpStyle::ColumnHeads`], `h` heads
//!   of columns `A_j`): `p/h` ranks hold each `A_j`, and rank `r` computes `Y_r = X A_{j(r)}` for
//!   its own query heads, so `∂L/∂A_j = Σ_{r: j(r) = j} Xᵀ ∂L/∂Y_r` is summed over the ranks
//!   holding `A_j` in the backward. The input's gradient `Σ_r ∂L/∂Y_r A_{j(r)}ᵀ` is `f`'s
//!   all-reduce, as for any column split.
//! - **Vocabulary-parallel embedding** (`E: [V, d]` by rows): rank `r` holds rows
//!   `[s_r, e_r)`, looks up the ids in its range (others give zero rows) and the lookups are
//!   all-reduced (`g`). Exactly one rank contributes each row, so the sum is exact.
//!
//! **Sequence parallelism** (Megatron-LM's SP): between a row-parallel layer and the next
//! column-parallel one (norms, dropout, residual adds) each rank holds part `r` of the
//! activation along the plan's sequence dimension instead of the whole. A column-parallel layer
//! then all-gathers its input along it (backward: reduce-scatter of the gradient) instead of
//! `f`, and a row-parallel layer reduce-scatters its output (backward: all-gather) instead of
//! `g`'s all-reduce. The communicated volume is the same (an all-reduce is a reduce-scatter and
//! an all-gather); the activations between the layers shrink `p`-fold.
//!
//! With ranks as threads, each rank must pass tensors of its own (e.g. drawn by it, or made from
//! data): clones of one autodiff tensor share its graph node, and ranks whose graphs share a
//! node share one graph lock, which deadlocks their backward collectives.

use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear};
use burn::tensor::backend::Backend;
use burn::tensor::module::linear;
use burn::tensor::ops::PadMode;
use burn::tensor::{FloatDType, Int, Tensor};
use wildfire_backend::collective::{
    self, CollectiveBackend, copy_to_parallel_region, gather_from_parallel_region,
    reduce_from_parallel_region, reduce_scatter_to_sequence_region,
};
use wildfire_backend::comm::{CommError, ProcessGroup, ReduceOp};
use wildfire_backend::kernels::cross_entropy::{
    FusedCrossEntropyBackend, HeadLayout, LinearCrossEntropy, ids_in_part,
};

use super::plan::{TpPlan, TpStyle};
use super::slot::{TensorParallel, collective};
use super::walk::{Applied, Layer, vocabulary_part};
use crate::precision::in_dtype;

/// A linear layer `Y = XA + b` (`weight: [n_in, n_out]`, as Burn's `Linear`) that a
/// tensor-parallel plan may split by columns or rows (see the module doc). Unsplit, it is
/// Burn's `Linear`; build it from one (`ParallelLinear::from(linear)`).
#[derive(Module, Debug)]
pub struct ParallelLinear<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// How the plan split it (nothing until [`super::apply_plan`]).
    pub tp: TensorParallel<B>,
}

impl<B: Backend> From<Linear<B>> for ParallelLinear<B> {
    fn from(linear: Linear<B>) -> Self {
        Self {
            weight: linear.weight,
            bias: linear.bias,
            tp: TensorParallel::for_layer(Layer::Linear),
        }
    }
}

/// `y + b` in `y`'s type (the bias cast to it); `y` without a bias.
fn add_bias<B: Backend, const D: usize>(
    y: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    match bias {
        Some(bias) => {
            let dtype = FloatDType::from(y.dtype());
            y + in_dtype(bias, dtype).unsqueeze()
        }
        None => y,
    }
}

impl<B: Backend> ParallelLinear<B> {
    /// This rank's part of the layer with the whole `weight: [n_in, n_out]` and `bias`, split
    /// over `group` as `style` says (column or row; the activations between tensor-parallel
    /// regions split along `sequence_dim` under sequence parallelism): what [`super::apply_plan`]
    /// makes of a layer its plan names, for a layer built on its own. Sizes need not divide
    /// (rank `r` holds part `r` of `split_ranges`).
    pub fn split_from(
        weight: Tensor<B, 2>,
        bias: Option<Tensor<B, 1>>,
        style: TpStyle,
        group: &ProcessGroup,
        sequence_dim: Option<usize>,
    ) -> Self {
        let plan = TpPlan::new(&[("layer", style)], group.rank(), group.size());
        let weight_dims = weight.dims();
        Self {
            weight: Param::from_tensor(plan.local_part("layer.weight", weight)),
            bias: bias.map(|b| Param::from_tensor(plan.local_part("layer.bias", b))),
            tp: TensorParallel::for_layer(Layer::Linear).with_applied(Applied {
                group: group.clone(),
                style: Some(style),
                part: vocabulary_part(style, &weight_dims, group.rank(), group.size()),
                sequence_dim,
            }),
        }
    }
}

impl<B: CollectiveBackend> ParallelLinear<B> {
    /// `XA + b` (this rank's part of it where the plan splits the layer).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        if self.tp.style().is_none() {
            let dtype = FloatDType::from(x.dtype());
            let bias = self.bias.as_ref().map(|b| in_dtype(b.val(), dtype));
            return linear(x, in_dtype(self.weight.val(), dtype), bias);
        }
        self.forward_with(x, add_bias)
    }

    /// [`forward`](Self::forward) with `epilogue(XA, b)` in place of the bias add, for an
    /// elementwise op fused with it (a bias + GELU): `XA` in `X`'s type (under a row split, the
    /// sum over ranks; under a column split, this rank's columns), `b` the fp32 bias (part) as
    /// it is.
    pub fn forward_with<const D: usize>(
        &self,
        x: Tensor<B, D>,
        epilogue: impl FnOnce(Tensor<B, D>, Option<Tensor<B, 1>>) -> Tensor<B, D>,
    ) -> Tensor<B, D> {
        let bias = (self.bias.as_ref()).map(|b| self.summed_over_copies(b.val(), "bias"));
        let (Some(group), Some(style)) = (self.tp.group(), self.tp.style()) else {
            return epilogue(self.product(x), bias);
        };
        let sequence_dim = self.tp.sequence_dim();
        let gather_output = match style {
            TpStyle::Row => {
                let partial = self.product(x);
                let y = match sequence_dim {
                    Some(dim) => reduce_scatter_to_sequence_region(partial, group, dim),
                    None => reduce_from_parallel_region(partial, group),
                };
                return epilogue(collective(y), bias);
            }
            TpStyle::Column { gather_output, .. } => gather_output,
            TpStyle::ColumnHeads { .. } | TpStyle::VocabColumns => false,
            _ => return epilogue(self.product(x), bias),
        };
        let y = epilogue(self.product(self.tp.enter_parallel_region(x)), bias);
        match gather_output {
            true => collective(gather_from_parallel_region(y, group, D - 1)),
            false => y,
        }
    }

    /// `XA` (this rank's weight) in `X`'s type.
    fn product<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dtype = FloatDType::from(x.dtype());
        let weight = self.summed_over_copies(self.weight.val(), "weight");
        linear(x, in_dtype(weight, dtype), None)
    }

    /// The value of parameter `name` (`weight` or `bias`) as the layer uses it: where other
    /// ranks hold copies of the same part (a [`TpStyle::ColumnHeads`] with fewer heads than
    /// ranks), through [`sum_over_copies`]; else as it is.
    fn summed_over_copies<const D: usize>(&self, value: Tensor<B, D>, name: &str) -> Tensor<B, D> {
        let (Some(group), Some(style)) = (self.tp.group(), self.tp.style()) else {
            return value;
        };
        let plan = TpPlan::new(&[("layer", style)], group.rank(), group.size());
        match plan.shared_part(&format!("layer.{name}"), D) {
            Some(part) => collective(sum_over_copies(value, part, group)),
            None => value,
        }
    }
}

impl<B: FusedCrossEntropyBackend> ParallelLinear<B> {
    /// This layer as a language model's head (`weight: [d, V]`, no bias) scored against
    /// `targets` (`x`'s leading shape) by `loss`, the fused cross-entropy that never holds the
    /// logits (`wildfire_backend::kernels::cross_entropy`): the summed token loss, a
    /// one-element f32 tensor. Split by vocabulary columns ([`TpStyle::VocabColumns`]) its input
    /// enters the tensor-parallel region as [`Self::forward`]'s does, each rank scores its
    /// columns and every rank gets the whole loss.
    ///
    /// # Panics
    /// When the layer has a bias or a plan split it otherwise than by vocabulary columns
    /// (naming the split), or the shapes disagree (see `LinearCrossEntropy::loss_sum`).
    pub fn cross_entropy_sum<const D: usize, const E: usize>(
        &self,
        x: Tensor<B, D>,
        targets: Tensor<B, E, Int>,
        loss: &LinearCrossEntropy,
    ) -> Tensor<B, 1> {
        assert!(
            self.bias.is_none(),
            "the fused cross-entropy scores a head without a bias; this one has {:?}",
            self.bias.as_ref().map(|b| b.dims())
        );
        let weight = in_dtype(self.weight.val(), FloatDType::from(x.dtype()));
        let layout = HeadLayout::VocabColumns;
        let (Some(group), Some(style)) = (self.tp.group(), self.tp.style()) else {
            return collective(loss.loss_sum(x, weight, layout, targets));
        };
        assert!(
            style == TpStyle::VocabColumns,
            "the fused cross-entropy scores a head split by vocabulary columns; this one is \
             {style}"
        );
        let start = self.tp.part().map_or(0, |part| part.start);
        let loss = loss.clone().with_vocab_shard(group, start);
        let x = self.tp.enter_parallel_region(x);
        collective(loss.loss_sum(x, weight, layout, targets))
    }
}

/// `value`, part `part` of `parts` equal parts along `dim` of a whole tensor whose parts the
/// ranks of `group` hold in copies, made so that its gradient becomes the sum of the gradients
/// of every rank holding the same part: padded with zeros to the whole tensor, passed through
/// `f` (identity forward, all-reduce backward) and cut out again. The other parts' places hold
/// zeros, which add exactly, so each part's sum is over its copies alone; every rank receives
/// the same sums, so the copies stay equal through an update.
fn sum_over_copies<B: CollectiveBackend, const D: usize>(
    value: Tensor<B, D>,
    (dim, part, parts): (usize, usize, usize),
    group: &ProcessGroup,
) -> Result<Tensor<B, D>, CommError> {
    let width = value.dims()[dim];
    let mut padding = [(0, 0); D];
    padding[dim] = (part * width, (parts - 1 - part) * width);
    let whole = value.pad(padding, PadMode::Constant(0.0));
    let whole = copy_to_parallel_region(whole, group)?;
    Ok(whole.narrow(dim, part * width, width))
}

/// An embedding table `E: [V, d]` that a tensor-parallel plan may split by vocabulary rows (see
/// the module doc). Unsplit, it is Burn's `Embedding`; build it from one.
#[derive(Module, Debug)]
pub struct ParallelEmbedding<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    /// How the plan split it (nothing until [`super::apply_plan`]).
    pub tp: TensorParallel<B>,
}

impl<B: Backend> From<Embedding<B>> for ParallelEmbedding<B> {
    fn from(embedding: Embedding<B>) -> Self {
        Self {
            weight: embedding.weight,
            tp: TensorParallel::for_layer(Layer::Embedding),
        }
    }
}

impl<B: Backend> ParallelEmbedding<B> {
    /// This rank's rows of the whole table `weight: [V, d]` split over `group`: what
    /// [`super::apply_plan`] makes of a table its plan splits by vocabulary rows, for a table
    /// built on its own.
    pub fn split_from(weight: Tensor<B, 2>, group: &ProcessGroup) -> Self {
        let plan = TpPlan::new(&[("table", TpStyle::VocabRows)], group.rank(), group.size());
        let rows = vocabulary_part(
            TpStyle::VocabRows,
            &weight.dims(),
            group.rank(),
            group.size(),
        );
        Self {
            weight: Param::from_tensor(plan.local_part("table.weight", weight)),
            tp: TensorParallel::for_layer(Layer::Embedding).with_applied(Applied {
                group: group.clone(),
                style: Some(TpStyle::VocabRows),
                part: rows,
                sequence_dim: None,
            }),
        }
    }
}

impl<B: CollectiveBackend> ParallelEmbedding<B> {
    /// Rows of `ids: [batch, seq]` → `[batch, seq, d]`, whole on every rank.
    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let (Some(group), Some(TpStyle::VocabRows)) = (self.tp.group(), self.tp.style()) else {
            return burn::tensor::module::embedding(self.weight.val(), ids);
        };
        let rows = self.weight.val().dims()[0];
        let (local, inside) = ids_in_part(ids, self.vocab_start(), rows);
        let rows = burn::tensor::module::embedding(self.weight.val(), local);
        let masked = rows * inside.unsqueeze_dim::<3>(2);
        collective(reduce_from_parallel_region(masked, group))
    }

    /// The first vocabulary row this rank holds (0 unsplit).
    pub fn vocab_start(&self) -> usize {
        self.tp.part().map_or(0, |part| part.start)
    }
}

/// Cross-entropy summed over tokens from vocabulary-parallel logits `logits_r: [batch, seq,
/// V_r]` (rank `r`'s columns `[vocab_start, vocab_start + V_r)` of the full logits), without
/// gathering the full logits:
///
/// ```text
/// m      = max_q max_j l_qj                    all-reduce (max), no gradient (ℓ is shift-invariant)
/// S      = Σ_q Σ_j exp(l_qj − m)               g: all-reduce forward, identity backward
/// l_t    = Σ_q [t ∈ part q] (l_qt − m)          g
/// ℓ      = valid · (log S − l_t)                valid = [t ≠ ignore_index]
/// ```
///
/// Every rank computes the same `ℓ`, and each backpropagates its own copy: through `g` rank `r`
/// gets `∂ℓ/∂l_rj = valid · (exp(l_rj − m)/S − [j = t])`, the softmax-minus-one-hot of its own
/// columns, which is the serial gradient's part `r`. This is the decomposed loss, which holds
/// the logits; [`ParallelLinear::cross_entropy_sum`] and
/// [`TensorParallel::head_cross_entropy_sum`] compute the same loss without them.
pub fn vocab_parallel_cross_entropy<B: CollectiveBackend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
    vocab_start: usize,
    ignore_index: i64,
    group: &ProcessGroup,
) -> Result<Tensor<B, 1>, CommError> {
    let [batch, seq, part_vocab] = logits.dims();
    let logits = logits.reshape([batch * seq, part_vocab]);
    let targets = targets.reshape([batch * seq]);
    let local_max = logits.clone().detach().max_dim(1);
    let max = collective::all_reduce(local_max, group, ReduceOp::Max)?;
    let shifted = logits - max;
    let sum_exp = reduce_from_parallel_region(shifted.clone().exp().sum_dim(1), group)?;
    let valid = targets.clone().not_equal_elem(ignore_index).float();
    let (local, inside) = ids_in_part(targets, vocab_start, part_vocab);
    let picked = shifted.gather(1, local.unsqueeze_dim(1)) * inside.unsqueeze_dim(1);
    let target = reduce_from_parallel_region(picked, group)?;
    Ok(((sum_exp.log() - target) * valid.unsqueeze_dim(1)).sum())
}
