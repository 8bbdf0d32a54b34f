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
//! The product runs in `X`'s type: fp32 weights meet bf16 or fp16 activations cast to them
//! (see [`crate::precision`]).
//!
//! **Sequence parallelism** (Megatron-LM's SP, for activations `[batch, seq, features]`): between
//! a row-parallel layer and the next column-parallel one (LayerNorm, dropout, residual adds) each
//! rank holds part `r` of the sequence instead of the whole. A column-parallel layer then
//! all-gathers its input along the sequence (backward: reduce-scatter of the gradient) instead
//! of `f`, and a row-parallel layer reduce-scatters its output along the sequence (backward:
//! all-gather) instead of `g`'s all-reduce. The communicated volume is the same (an all-reduce
//! is a reduce-scatter and an all-gather); the activations between the layers shrink `p`-fold.

use std::ops::Range;

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::module::linear;
use burn::tensor::{FloatDType, Int, Tensor};
use wildfire_backend::collective::{
    self, CollectiveBackend, all_gather_from_sequence_region, copy_to_parallel_region,
    gather_from_parallel_region, reduce_from_parallel_region, reduce_scatter_to_sequence_region,
};
use wildfire_backend::comm::{CommError, ProcessGroup, ReduceOp, split_ranges};

use crate::precision::in_dtype;

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

/// A copy of `t` with its own storage and no graph: a parameter made from a slice of the whole
/// weight must be a leaf (on an autodiff backend a slice is not), and must not keep the whole
/// weight's storage alive (a slice can be a view of it).
fn owned<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    let device = t.device();
    Tensor::from_data(t.into_data(), &device)
}

/// What rank `rank` of `size` holds of a dimension of `len` entries cut into `sections` equal
/// sections (3 for a fused QKV projection, 1 otherwise): its part (`split_ranges`) of each.
fn section_parts(len: usize, sections: usize, rank: usize, size: usize) -> Vec<Range<usize>> {
    let width = len / sections;
    let part = split_ranges(width, size)[rank].clone();
    (0..sections)
        .map(|s| s * width + part.start..s * width + part.end)
        .collect()
}

/// Part `rank` of `total` along a dimension.
fn part(total: usize, group: &ProcessGroup) -> Range<usize> {
    section_parts(total, 1, group.rank(), group.size()).remove(0)
}

/// What rank `rank` of `size` holds of `full` along `dim` cut into `sections` equal sections
/// (see [`section_parts`]): its parts, concatenated in order, as an [`owned`] copy.
fn rank_part<B: Backend, const D: usize>(
    full: Tensor<B, D>,
    dim: usize,
    sections: usize,
    (rank, size): (usize, usize),
) -> Tensor<B, D> {
    let parts = section_parts(full.dims()[dim], sections, rank, size)
        .into_iter()
        .map(|range| full.clone().narrow(dim, range.start, range.len()))
        .collect();
    owned(Tensor::cat(parts, dim))
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
        let rank = (group.rank(), group.size());
        Self {
            weight: Param::from_tensor(rank_part(weight, 1, sections, rank)),
            bias: bias.map(|b| Param::from_tensor(rank_part(b, 0, sections, rank))),
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
        self.forward_with(x, add_bias)
    }

    /// [`forward`](Self::forward) with `epilogue(X A_r, b_r)` in place of the bias add, for an
    /// elementwise op fused with it (the GPT's bias + GELU): `X A_r` in `X`'s type, `b_r` the
    /// fp32 bias part as it is.
    pub fn forward_with<const D: usize>(
        &self,
        x: Tensor<B, D>,
        epilogue: impl FnOnce(Tensor<B, D>, Option<Tensor<B, 1>>) -> Tensor<B, D>,
    ) -> Result<Tensor<B, D>, CommError> {
        let group = group_of(&self.group);
        let x = if self.sequence_parallel {
            all_gather_from_sequence_region(x, group, 1)?
        } else {
            copy_to_parallel_region(x, group)?
        };
        let dtype = FloatDType::from(x.dtype());
        let product = linear(x, in_dtype(self.weight.val(), dtype), None);
        let y = epilogue(product, self.bias.as_ref().map(Param::val));
        match self.gather_output {
            true => gather_from_parallel_region(y, group, D - 1),
            false => Ok(y),
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

impl<B: CollectiveBackend> RowParallelLinear<B> {
    /// This rank's rows of the serial layer's `weight: [n_in, n_out]`; the bias whole.
    pub fn from_full(
        weight: Tensor<B, 2>,
        bias: Option<Tensor<B, 1>>,
        group: &ProcessGroup,
    ) -> Self {
        Self {
            weight: Param::from_tensor(rank_part(weight, 0, 1, (group.rank(), group.size()))),
            bias: bias.map(|b| Param::from_tensor(owned(b))),
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
        let dtype = FloatDType::from(x.dtype());
        let partial = linear(x, in_dtype(self.weight.val(), dtype), None);
        let group = group_of(&self.group);
        let y = if self.sequence_parallel {
            reduce_scatter_to_sequence_region(partial, group, 1)?
        } else {
            reduce_from_parallel_region(partial, group)?
        };
        Ok(add_bias(y, self.bias.as_ref().map(Param::val)))
    }
}

impl<B: CollectiveBackend> VocabParallelEmbedding<B> {
    /// This rank's rows of the serial table `weight: [V, d]`.
    pub fn from_full(weight: Tensor<B, 2>, group: &ProcessGroup) -> Self {
        Self {
            vocab_start: part(weight.dims()[0], group).start,
            weight: Param::from_tensor(rank_part(weight, 0, 1, (group.rank(), group.size()))),
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

/// How one layer (or one parameter) of a model is split over the `p` ranks of a
/// tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpStyle {
    /// [`ColumnParallelLinear`]: the weight's output columns (dimension 1) and the bias split, in
    /// each of `sections` equal blocks (3 for a fused QKV projection).
    Column { sections: usize },
    /// [`RowParallelLinear`]: the weight's input rows (dimension 0) split, the bias whole.
    Row,
    /// [`VocabParallelEmbedding`] (or a tied head's copy of its table): rows split.
    VocabRows,
    /// Whole on every rank, applied inside the sequence-parallel region (a LayerNorm): under
    /// sequence parallelism each rank's gradient covers its part of the sequence only.
    SequenceRegion,
}

/// A box of a tensor: `shape` elements from `offset`, per dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorBox {
    pub offset: Vec<usize>,
    pub shape: Vec<usize>,
}

/// A tensor-parallel plan: which layer of a model gets which [`TpStyle`], as data, for rank
/// `rank` of a group of `size`. A rule names a module path whose components may be `*` (any one
/// component), e.g. `blocks.*.attn.c_attn`; it covers the parameters directly under that path
/// (`blocks.3.attn.c_attn.weight`) and a parameter at exactly that path (`head.wte`). Parameters
/// no rule covers are replicated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpPlan {
    rules: Vec<(Vec<String>, TpStyle)>,
    pub rank: usize,
    pub size: usize,
}

impl TpPlan {
    /// `rules` for rank `rank` of `size`.
    pub fn new(rules: &[(&str, TpStyle)], rank: usize, size: usize) -> Self {
        let rules = rules
            .iter()
            .map(|(path, style)| (path.split('.').map(str::to_string).collect(), *style))
            .collect();
        Self { rules, rank, size }
    }

    /// The plan of a model that is not split: everything whole.
    pub fn serial() -> Self {
        Self::new(&[], 0, 1)
    }

    /// The style of the layer or parameter at `path`, if a rule covers it (see [`TpPlan`]).
    pub fn style(&self, path: &str) -> Option<TpStyle> {
        let parts: Vec<&str> = path.split('.').collect();
        self.rules.iter().find_map(|(pattern, style)| {
            let covers = (parts.len() == pattern.len() || parts.len() == pattern.len() + 1)
                && pattern
                    .iter()
                    .zip(&parts)
                    .all(|(want, have)| want == "*" || want == have);
            covers.then_some(*style)
        })
    }

    /// The dimension along which parameter `path` of rank `dims` is split, and in how many
    /// equal sections; `None` when every rank holds it whole.
    fn split(&self, path: &str, dims: usize) -> Option<(usize, usize)> {
        if self.size == 1 {
            return None;
        }
        match (self.style(path)?, dims) {
            (TpStyle::Column { sections }, 2) => Some((1, sections)),
            (TpStyle::Column { sections }, 1) => Some((0, sections)),
            (TpStyle::Row | TpStyle::VocabRows, 2) => Some((0, 1)),
            _ => None,
        }
    }

    /// The dimension along which parameter `path` (of rank `dims`) is split; `None` when every
    /// rank holds it whole.
    pub fn split_dim(&self, path: &str, dims: usize) -> Option<usize> {
        self.split(path, dims).map(|(dim, _)| dim)
    }

    /// Whether every rank holds a different part of parameter `path` (of rank `dims`).
    pub fn is_split(&self, path: &str, dims: usize) -> bool {
        self.split(path, dims).is_some()
    }

    /// Whether, under sequence parallelism, this rank's gradient of the whole parameter `path`
    /// (of rank `dims`) is only its part of the sequence's, to be summed over the group: a
    /// [`TpStyle::SequenceRegion`] layer's parameters, and a row-parallel layer's bias (added
    /// after the reduce-scatter).
    pub fn is_sequence_partial(&self, path: &str, dims: usize) -> bool {
        matches!(
            (self.style(path), dims),
            (Some(TpStyle::SequenceRegion), _) | (Some(TpStyle::Row), 1)
        )
    }

    /// The boxes of the global tensor `path` (shape `global`) that this rank holds, in the order
    /// its local tensor concatenates them along the split dimension: one box, or one per
    /// section of a sectioned column split; the whole tensor when it is not split.
    pub fn boxes(&self, path: &str, global: &[usize]) -> Vec<TensorBox> {
        let whole = TensorBox {
            offset: vec![0; global.len()],
            shape: global.to_vec(),
        };
        let Some((dim, sections)) = self.split(path, global.len()) else {
            return vec![whole];
        };
        section_parts(global[dim], sections, self.rank, self.size)
            .into_iter()
            .map(|part| {
                let mut tensor_box = whole.clone();
                tensor_box.offset[dim] = part.start;
                tensor_box.shape[dim] = part.len();
                tensor_box
            })
            .collect()
    }

    /// This rank's part of the global tensor `full` of parameter `path`: its boxes, concatenated
    /// along the split dimension, as a copy (`full` itself when it is not split).
    pub fn local_part<B: Backend, const D: usize>(
        &self,
        path: &str,
        full: Tensor<B, D>,
    ) -> Tensor<B, D> {
        match self.split(path, D) {
            Some((dim, sections)) => rank_part(full, dim, sections, (self.rank, self.size)),
            None => full,
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;

    use super::*;

    const PLAN: &[(&str, TpStyle)] = &[
        ("blocks.*.attn.c_attn", TpStyle::Column { sections: 3 }),
        ("blocks.*.attn.c_proj", TpStyle::Row),
        ("head.wte", TpStyle::VocabRows),
        ("blocks.*.ln_1", TpStyle::SequenceRegion),
    ];

    #[test]
    fn rules_cover_the_parameters_under_a_path_or_at_it() {
        let plan = TpPlan::new(PLAN, 1, 2);
        let column = Some(TpStyle::Column { sections: 3 });
        assert_eq!(plan.style("blocks.7.attn.c_attn.weight"), column);
        assert_eq!(plan.style("blocks.7.attn.c_attn"), column);
        assert_eq!(plan.style("head.wte"), Some(TpStyle::VocabRows));
        assert_eq!(plan.style("blocks.7.attn.c_attn.weight.extra"), None);
        assert_eq!(plan.style("blocks.7.mlp.c_fc.weight"), None);
        assert!(plan.is_split("blocks.0.attn.c_proj.weight", 2));
        assert!(!plan.is_split("blocks.0.attn.c_proj.bias", 1));
        assert!(plan.is_sequence_partial("blocks.0.attn.c_proj.bias", 1));
        assert!(plan.is_sequence_partial("blocks.0.ln_1.gamma", 1));
        assert!(!plan.is_sequence_partial("blocks.0.attn.c_attn.bias", 1));
        assert!(!TpPlan::new(PLAN, 0, 1).is_split("blocks.0.attn.c_proj.weight", 2));
    }

    /// Rank 1 of 2 holds, of each of Q, K and V (5 columns each, split 3 + 2), the last 2
    /// columns; of a row-parallel weight's 7 rows, the last 3.
    #[test]
    fn boxes_follow_split_ranges_per_section() {
        let plan = TpPlan::new(PLAN, 1, 2);
        let boxes = plan.boxes("blocks.0.attn.c_attn.weight", &[4, 15]);
        let offsets: Vec<Vec<usize>> = boxes.iter().map(|b| b.offset.clone()).collect();
        assert_eq!(offsets, [[0, 3], [0, 8], [0, 13]]);
        assert!(boxes.iter().all(|b| b.shape == [4, 2]));
        let bias = plan.boxes("blocks.0.attn.c_attn.bias", &[15]);
        assert_eq!(
            bias.iter().map(|b| b.offset[0]).collect::<Vec<_>>(),
            [3, 8, 13]
        );
        let row = plan.boxes("blocks.0.attn.c_proj.weight", &[7, 4]);
        assert_eq!(
            row,
            [TensorBox {
                offset: vec![4, 0],
                shape: vec![3, 4]
            }]
        );
        let whole = plan.boxes("blocks.0.ln_1.gamma", &[4]);
        assert_eq!(whole[0].shape, [4]);
    }

    /// `local_part` concatenates the boxes along the split dimension: the same columns
    /// `ColumnParallelLinear::from_full` keeps.
    #[test]
    fn the_local_part_is_the_boxes_in_order() {
        let plan = TpPlan::new(PLAN, 1, 2);
        let full: Vec<f32> = (0..60).map(|v| v as f32).collect();
        let full = Tensor::<Flex, 2>::from_data(
            burn::tensor::TensorData::new(full, [4, 15]),
            &Default::default(),
        );
        let part = plan.local_part("blocks.0.attn.c_attn.weight", full);
        assert_eq!(part.dims(), [4, 6]);
        let first_row: Vec<f32> = part.slice([0..1, 0..6]).into_data().to_vec().unwrap();
        assert_eq!(first_row, [3.0, 4.0, 8.0, 9.0, 13.0, 14.0]);
    }
}
