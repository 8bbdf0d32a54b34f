//! The tensor-parallel plan as data: which parameter path gets which [`TpStyle`], checked
//! against a model's parameters before anything is split ([`TpPlan::check`]), and the geometry
//! of each split (which boxes of the whole tensor a rank holds, for checkpoints).

use std::fmt;
use std::ops::Range;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use wildfire_backend::comm::split_ranges;
use wildfire_backend::host_data::aligned;

/// How one layer (or one parameter) of a model is split over the `p` ranks of a
/// tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpStyle {
    /// A [`super::ParallelLinear`] split by output columns: the weight's dimension 1 and the
    /// bias, in each of `sections` equal blocks (3 for a fused QKV projection, so every rank
    /// gets the same heads of Q, K and V). Its output stays split (`[.., n_out/p]`, for a
    /// following row-parallel layer or a vocabulary-parallel loss) unless `gather_output`.
    Column {
        sections: usize,
        gather_output: bool,
    },
    /// A [`super::ParallelLinear`] split by input rows (the weight's dimension 0), the bias
    /// whole: its input is a column-parallel layer's split output, its output the sum.
    Row,
    /// A [`super::ParallelEmbedding`] (or a bare table parameter, e.g. a tied head's copy of
    /// it) split by rows. The rows need not divide: each rank holds `split_ranges(V, p)`'s part.
    VocabRows,
    /// An output head (a [`super::ParallelLinear`] `[d, V]`) split by vocabulary columns:
    /// column-parallel, its logits left split for [`super::vocab_parallel_cross_entropy`]. As
    /// for [`TpStyle::VocabRows`], the vocabulary need not divide.
    VocabColumns,
    /// A [`super::ParallelLinear`] split by output columns in whole `heads` of equal width
    /// (grouped-query attention's key/value projections). Where `p` divides `heads`, rank `r`
    /// holds its `heads/p` of them, as [`TpStyle::COLUMN`]. Where `heads` divides `p` (fewer
    /// heads than ranks, as inference engines do), each head is held by `p/heads` ranks: rank `r`
    /// holds head `r/(p/heads)`, and the gradient of a head's weight is the sum of those ranks'
    /// (each computes only its own query heads' share). Any other pair is refused.
    ColumnHeads { heads: usize },
    /// Whole on every rank.
    Replicated,
    /// Whole on every rank, applied inside the sequence-parallel region (a LayerNorm): under
    /// sequence parallelism each rank's gradient covers its part of the sequence only, and the
    /// group sums them ([`super::SequencePartial`]).
    SequenceRegion,
    /// Whole on every rank, applied to each of the rank's own heads (Qwen3's RMSNorm of each
    /// head of Q and K): each rank's gradient covers its heads only, and the group sums them,
    /// with or without sequence parallelism ([`super::SequencePartial`]).
    HeadShared,
}

impl TpStyle {
    /// Column-parallel in one section, the output left split: the first layer of a pair.
    pub const COLUMN: Self = Self::Column {
        sections: 1,
        gather_output: false,
    };
}

impl fmt::Display for TpStyle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Column { sections: 1, .. } => write!(f, "column-parallel"),
            Self::Column { sections, .. } => write!(f, "column-parallel in {sections} sections"),
            Self::ColumnHeads { heads } => write!(f, "column-parallel by {heads} heads"),
            Self::Row => write!(f, "row-parallel"),
            Self::VocabRows => write!(f, "vocabulary-parallel by rows"),
            Self::VocabColumns => write!(f, "vocabulary-parallel by columns"),
            Self::Replicated => write!(f, "replicated"),
            Self::SequenceRegion => write!(f, "sequence-region"),
            Self::HeadShared => write!(f, "head-shared"),
        }
    }
}

/// A box of a tensor: `shape` elements from `offset`, per dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorBox {
    pub offset: Vec<usize>,
    pub shape: Vec<usize>,
}

/// Why a plan does not fit a model, naming the path and the sizes involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "the tensor-parallel plan's rule `{rule}` matches no parameter of the model (its \
         parameters include {examples})"
    )]
    NoMatch { rule: String, examples: String },
    #[error(
        "parameter `{path}` is matched by two rules of the tensor-parallel plan: `{first}` and `{second}`"
    )]
    Ambiguous {
        path: String,
        first: String,
        second: String,
    },
    #[error(
        "parameter `{path}` of shape {shape:?} cannot be split {style} over {tp} ranks: \
         dimension {dim} holds {len} entries, not a multiple of {multiple}"
    )]
    Indivisible {
        path: String,
        shape: Vec<usize>,
        style: TpStyle,
        tp: usize,
        dim: usize,
        len: usize,
        multiple: usize,
    },
    #[error(
        "parameter `{path}` holds {heads} heads, which cannot be split over {tp} ranks: each \
         rank holds whole heads (tp dividing the heads) or one head shared with other ranks \
         (the heads dividing tp), and neither {heads} nor {tp} divides the other"
    )]
    HeadsAndRanks {
        path: String,
        heads: usize,
        tp: usize,
    },
    #[error(
        "parameter `{path}` of shape {shape:?} cannot be split {style}: that style splits \
         matrices and their biases"
    )]
    WrongRank {
        path: String,
        shape: Vec<usize>,
        style: TpStyle,
    },
    #[error("`{path}` is {found}, but the plan makes it {style}, which needs {needed}")]
    WrongLayer {
        path: String,
        found: String,
        style: TpStyle,
        needed: &'static str,
    },
    #[error(
        "the tensor-parallel plan is for rank {plan_rank} of {plan_size}, but the group's rank \
         is {group_rank} of {group_size}"
    )]
    WrongGroup {
        plan_rank: usize,
        plan_size: usize,
        group_rank: usize,
        group_size: usize,
    },
}

/// A tensor-parallel plan: which layer of a model gets which [`TpStyle`], as data, for rank
/// `rank` of a group of `size`, and whether the activations between the tensor-parallel regions
/// are split along a sequence dimension (sequence parallelism). A rule names a module path whose
/// components may be `*` (any one component), e.g. `blocks.*.attn.c_attn`; it covers the
/// parameters directly under that path (`blocks.3.attn.c_attn.weight`) and a parameter at
/// exactly that path (`head.wte`). Parameters no rule covers are replicated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpPlan {
    rules: Vec<(String, TpStyle)>,
    pub rank: usize,
    pub size: usize,
    /// The dimension along which the activations of the sequence-parallel region are split
    /// (1 for `[batch, seq, d]`); `None` without sequence parallelism.
    pub sequence_dim: Option<usize>,
}

/// Whether rule `pattern` covers `path`: the parameters directly under it, or it exactly.
fn covers(pattern: &str, path: &str) -> bool {
    let (pattern, parts): (Vec<&str>, Vec<&str>) =
        (pattern.split('.').collect(), path.split('.').collect());
    (parts.len() == pattern.len() || parts.len() == pattern.len() + 1)
        && pattern
            .iter()
            .zip(&parts)
            .all(|(want, have)| *want == "*" || want == have)
}

impl TpPlan {
    /// `rules` for rank `rank` of `size`, without sequence parallelism.
    pub fn new(rules: &[(&str, TpStyle)], rank: usize, size: usize) -> Self {
        let rules = rules
            .iter()
            .map(|(path, style)| (path.to_string(), *style))
            .collect();
        Self {
            rules,
            rank,
            size,
            sequence_dim: None,
        }
    }

    /// The plan of a model that is not split: everything whole.
    pub fn serial() -> Self {
        Self::new(&[], 0, 1)
    }

    /// The same plan with the sequence-parallel region's activations split along `dim` (the
    /// sequence dimension: 1 for `[batch, seq, d]`), or not (`None`).
    pub fn with_sequence_parallel(self, dim: Option<usize>) -> Self {
        Self {
            sequence_dim: dim,
            ..self
        }
    }

    /// The rule covering `path` and its style, if any (the first, where [`TpPlan::check`] has
    /// not been run; it refuses a path two rules cover).
    fn rule(&self, path: &str) -> Option<&(String, TpStyle)> {
        self.rules.iter().find(|(pattern, _)| covers(pattern, path))
    }

    /// The style of a rule naming exactly `path` (a layer, or a bare parameter), if any.
    pub(crate) fn exact_style(&self, path: &str) -> Option<TpStyle> {
        let depth = path.split('.').count();
        self.rules
            .iter()
            .find(|(pattern, _)| pattern.split('.').count() == depth && covers(pattern, path))
            .map(|(_, style)| *style)
    }

    /// The style of the layer or parameter at `path`, if a rule covers it (see [`TpPlan`]).
    pub fn style(&self, path: &str) -> Option<TpStyle> {
        self.rule(path).map(|(_, style)| *style)
    }

    /// Checks the plan against a model's parameters (`(path, shape)`, e.g. from
    /// [`crate::paths::param_shapes`]): every rule matches a parameter, no parameter is matched
    /// twice, and every split is of a matrix or bias and divides (the vocabulary rows need not).
    pub fn check(&self, params: &[(String, Vec<usize>)]) -> Result<(), PlanError> {
        for (rule, _) in &self.rules {
            if !params.iter().any(|(path, _)| covers(rule, path)) {
                let examples = params.iter().take(4).map(|(path, _)| format!("`{path}`"));
                return Err(PlanError::NoMatch {
                    rule: rule.clone(),
                    examples: examples.collect::<Vec<_>>().join(", "),
                });
            }
        }
        for (path, shape) in params {
            let mut matching = self.rules.iter().filter(|(rule, _)| covers(rule, path));
            let Some((first, style)) = matching.next() else {
                continue;
            };
            if let Some((second, _)) = matching.next() {
                return Err(PlanError::Ambiguous {
                    path: path.clone(),
                    first: first.clone(),
                    second: second.clone(),
                });
            }
            self.check_split(path, shape, *style)?;
        }
        Ok(())
    }

    /// Whether parameter `path` of `shape` can take `style` over this plan's ranks.
    fn check_split(&self, path: &str, shape: &[usize], style: TpStyle) -> Result<(), PlanError> {
        let (dim, multiple) = match (style, shape.len()) {
            (TpStyle::Replicated | TpStyle::SequenceRegion | TpStyle::HeadShared, _) => {
                return Ok(());
            }
            (TpStyle::Column { sections, .. }, 1 | 2) => (shape.len() - 1, sections * self.size),
            (TpStyle::VocabColumns, 1 | 2) => (shape.len() - 1, self.size),
            (TpStyle::ColumnHeads { heads }, 1 | 2) => {
                if !heads.is_multiple_of(self.size) && !self.size.is_multiple_of(heads) {
                    return Err(PlanError::HeadsAndRanks {
                        path: path.to_string(),
                        heads,
                        tp: self.size,
                    });
                }
                (shape.len() - 1, heads)
            }
            (TpStyle::Row, 2) | (TpStyle::VocabRows, 2) => (0, self.size),
            (TpStyle::Row, 1) => return Ok(()),
            _ => {
                return Err(PlanError::WrongRank {
                    path: path.to_string(),
                    shape: shape.to_vec(),
                    style,
                });
            }
        };
        let vocabulary = matches!(style, TpStyle::VocabRows | TpStyle::VocabColumns);
        let uneven_allowed = vocabulary && shape[dim] >= self.size;
        if shape[dim].is_multiple_of(multiple) || uneven_allowed {
            return Ok(());
        }
        Err(PlanError::Indivisible {
            path: path.to_string(),
            shape: shape.to_vec(),
            style,
            tp: self.size,
            dim,
            len: shape[dim],
            multiple,
        })
    }

    /// How parameter `path` of rank `dims` is cut; `None` when every rank holds it whole.
    fn cut(&self, path: &str, dims: usize) -> Option<Cut> {
        if self.size == 1 {
            return None;
        }
        let style = self.style(path)?;
        let dim = match (style, dims) {
            (TpStyle::Column { .. } | TpStyle::ColumnHeads { .. } | TpStyle::VocabColumns, 1) => 0,
            (TpStyle::Column { .. } | TpStyle::ColumnHeads { .. } | TpStyle::VocabColumns, 2) => 1,
            (TpStyle::Row | TpStyle::VocabRows, 2) => 0,
            _ => return None,
        };
        let sections = match style {
            TpStyle::Column { sections, .. } => sections,
            _ => 1,
        };
        let parts = match style {
            TpStyle::ColumnHeads { heads } if heads < self.size => heads,
            _ => self.size,
        };
        Some(Cut {
            dim,
            sections,
            part: self.rank / (self.size / parts),
            parts,
        })
    }

    /// The dimension along which parameter `path` (of rank `dims`) is split; `None` when every
    /// rank holds it whole.
    pub fn split_dim(&self, path: &str, dims: usize) -> Option<usize> {
        self.cut(path, dims).map(|cut| cut.dim)
    }

    /// Whether the plan cuts parameter `path` (of rank `dims`): every rank holds a part of it,
    /// a different one unless a [`TpStyle::ColumnHeads`] has fewer heads than ranks.
    pub fn is_split(&self, path: &str, dims: usize) -> bool {
        self.cut(path, dims).is_some()
    }

    /// How many ranks of the group hold the same part of parameter `path` (of rank `dims`) as
    /// this one: all of them for a parameter held whole, `p/heads` for a head of a
    /// [`TpStyle::ColumnHeads`] with fewer heads than ranks, else 1.
    pub fn replicas(&self, path: &str, dims: usize) -> usize {
        self.cut(path, dims)
            .map_or(self.size, |cut| self.size / cut.parts)
    }

    /// Whether this rank holds the first copy of what it holds of parameter `path` (of rank
    /// `dims`): the copy a checkpoint stores and a gradient norm counts, once.
    pub fn holds_first_copy(&self, path: &str, dims: usize) -> bool {
        self.rank.is_multiple_of(self.replicas(path, dims))
    }

    /// This rank's part of parameter `path` (of rank `dims`) when other ranks hold the same
    /// part: `(dim, part, parts)`, the whole cut into `parts` equal parts along `dim`, of which
    /// this rank holds `part`. `None` when no other rank holds it, or every rank does whole.
    pub fn shared_part(&self, path: &str, dims: usize) -> Option<(usize, usize, usize)> {
        let cut = self.cut(path, dims)?;
        (cut.parts < self.size).then_some((cut.dim, cut.part, cut.parts))
    }

    /// Whether this rank's gradient of the whole parameter `path` (of rank `dims`) is only its
    /// part, to be summed over the group: a [`TpStyle::HeadShared`] parameter's (its heads'
    /// part) always, and under sequence parallelism (its part of the sequence) a
    /// [`TpStyle::SequenceRegion`] layer's parameters and a row-parallel layer's bias (added
    /// after the reduce-scatter).
    pub fn is_sequence_partial(&self, path: &str, dims: usize) -> bool {
        let style = self.style(path);
        style == Some(TpStyle::HeadShared)
            || (self.sequence_dim.is_some()
                && matches!(
                    (style, dims),
                    (Some(TpStyle::SequenceRegion), _) | (Some(TpStyle::Row), 1)
                ))
    }

    /// The boxes of the global tensor `path` (shape `global`) that this rank holds, in the order
    /// its local tensor concatenates them along the split dimension: one box, or one per
    /// section of a sectioned column split; the whole tensor when it is not split.
    pub fn boxes(&self, path: &str, global: &[usize]) -> Vec<TensorBox> {
        let whole = TensorBox {
            offset: vec![0; global.len()],
            shape: global.to_vec(),
        };
        let Some(cut) = self.cut(path, global.len()) else {
            return vec![whole];
        };
        let dim = cut.dim;
        section_parts(global[dim], cut.sections, cut.part, cut.parts)
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
        match self.cut(path, D) {
            Some(cut) => rank_part(full, cut.dim, cut.sections, (cut.part, cut.parts)),
            None => full,
        }
    }
}

/// How the plan cuts a parameter: along `dim`, in `sections` equal sections (3 for a fused QKV
/// projection), each cut into `parts` parts of which this rank holds `part` (its rank, unless
/// fewer heads than ranks make ranks share parts).
#[derive(Debug, Clone, Copy)]
struct Cut {
    dim: usize,
    sections: usize,
    part: usize,
    parts: usize,
}

/// The ids of a vocabulary of `vocab` tokens that rank `rank` of `size` holds when a plan splits
/// it (an embedding's rows, a head's columns, the loss's logits): consecutive ids, the first
/// `vocab mod size` ranks holding one more, so that the vocabulary need not divide (no padding).
pub fn vocabulary_share(vocab: usize, rank: usize, size: usize) -> Range<usize> {
    split_ranges(vocab, size)[rank].clone()
}

/// What rank `rank` of `size` holds of a dimension of `len` entries cut into `sections` equal
/// sections (3 for a fused QKV projection, 1 otherwise): its part (`split_ranges`) of each.
pub(crate) fn section_parts(
    len: usize,
    sections: usize,
    rank: usize,
    size: usize,
) -> Vec<Range<usize>> {
    let width = len / sections;
    let part = split_ranges(width, size)[rank].clone();
    (0..sections)
        .map(|s| s * width + part.start..s * width + part.end)
        .collect()
}

/// A copy of `t` with its own storage and no graph: a parameter made from a slice of the whole
/// weight must be a leaf (on an autodiff backend a slice is not), and must not keep the whole
/// weight's storage alive (a slice can be a view of it).
pub(crate) fn owned<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    let (device, dtype) = (t.device(), t.dtype());
    Tensor::from_data(aligned(t.into_data()), (&device, dtype))
}

/// What rank `rank` of `size` holds of `full` along `dim` cut into `sections` equal sections
/// (see [`section_parts`]): its parts, concatenated in order, as an [`owned`] copy.
pub(crate) fn rank_part<B: Backend, const D: usize>(
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

#[cfg(test)]
mod tests {
    use burn::backend::Flex;

    use super::*;

    const PLAN: &[(&str, TpStyle)] = &[
        (
            "blocks.*.attn.c_attn",
            TpStyle::Column {
                sections: 3,
                gather_output: false,
            },
        ),
        ("blocks.*.attn.c_proj", TpStyle::Row),
        ("head.wte", TpStyle::VocabRows),
        ("blocks.*.ln_1", TpStyle::SequenceRegion),
        ("blocks.*.attn.q_norm", TpStyle::HeadShared),
    ];

    #[test]
    fn rules_cover_the_parameters_under_a_path_or_at_it() {
        let plan = TpPlan::new(PLAN, 1, 2).with_sequence_parallel(Some(1));
        let column = Some(PLAN[0].1);
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
        let without_sp = TpPlan::new(PLAN, 1, 2);
        assert!(!without_sp.is_sequence_partial("blocks.0.ln_1.gamma", 1));
        // A norm applied to each of the rank's heads: its heads' part, summed with or without SP.
        for plan in [&plan, &without_sp] {
            assert!(plan.is_sequence_partial("blocks.0.attn.q_norm.gamma", 1));
            assert!(!plan.is_split("blocks.0.attn.q_norm.gamma", 1));
        }
        assert!(!TpPlan::new(PLAN, 0, 1).is_split("blocks.0.attn.c_proj.weight", 2));
    }

    /// Rank 1 of 2 holds, of each of Q, K and V (6 columns each, split 3 + 3), the last 3
    /// columns; of a row-parallel weight's 8 rows, the last 4.
    #[test]
    fn boxes_follow_split_ranges_per_section() {
        let plan = TpPlan::new(PLAN, 1, 2);
        let boxes = plan.boxes("blocks.0.attn.c_attn.weight", &[4, 18]);
        let offsets: Vec<Vec<usize>> = boxes.iter().map(|b| b.offset.clone()).collect();
        assert_eq!(offsets, [[0, 3], [0, 9], [0, 15]]);
        assert!(boxes.iter().all(|b| b.shape == [4, 3]));
        let bias = plan.boxes("blocks.0.attn.c_attn.bias", &[18]);
        let starts: Vec<usize> = bias.iter().map(|b| b.offset[0]).collect();
        assert_eq!(starts, [3, 9, 15]);
        let row = plan.boxes("blocks.0.attn.c_proj.weight", &[8, 4]);
        let expected = TensorBox {
            offset: vec![4, 0],
            shape: vec![4, 4],
        };
        assert_eq!(row, [expected]);
        let whole = plan.boxes("blocks.0.ln_1.gamma", &[4]);
        assert_eq!(whole[0].shape, [4]);
    }

    /// `local_part` concatenates the boxes along the split dimension: the columns a
    /// column-parallel layer keeps.
    #[test]
    fn the_local_part_is_the_boxes_in_order() {
        let plan = TpPlan::new(PLAN, 1, 2);
        let full: Vec<f32> = (0..72).map(|v| v as f32).collect();
        let full = Tensor::<Flex, 2>::from_data(
            burn::tensor::TensorData::new(full, [4, 18]),
            &Default::default(),
        );
        let part = plan.local_part("blocks.0.attn.c_attn.weight", full);
        assert_eq!(part.dims(), [4, 9]);
        let first_row: Vec<f32> = part.slice([0..1, 0..9]).into_data().to_vec().unwrap();
        assert_eq!(
            first_row,
            [3.0, 4.0, 5.0, 9.0, 10.0, 11.0, 15.0, 16.0, 17.0]
        );
    }

    /// With fewer heads than ranks, ranks share a head: 2 heads of 4 columns over 4 ranks put
    /// head 0 on ranks 0 and 1, head 1 on ranks 2 and 3, each stored and counted by the first of
    /// its ranks; with more heads than ranks it is a column split.
    #[test]
    fn ranks_share_heads_where_there_are_fewer_heads_than_ranks() {
        let rules = [("attn.k_proj", TpStyle::ColumnHeads { heads: 2 })];
        let global = [6, 8];
        for (rank, offset, first) in [(0, 0, true), (1, 0, false), (2, 4, true), (3, 4, false)] {
            let plan = TpPlan::new(&rules, rank, 4);
            let expected = TensorBox {
                offset: vec![0, offset],
                shape: vec![6, 4],
            };
            assert_eq!(plan.boxes("attn.k_proj.weight", &global), [expected]);
            assert_eq!(plan.replicas("attn.k_proj.weight", 2), 2);
            assert_eq!(plan.holds_first_copy("attn.k_proj.weight", 2), first);
            assert_eq!(
                plan.shared_part("attn.k_proj.bias", 1),
                Some((0, rank / 2, 2))
            );
        }
        let split = TpPlan::new(&rules, 1, 2);
        assert_eq!(split.boxes("attn.k_proj.weight", &global)[0].offset, [0, 4]);
        assert_eq!(split.replicas("attn.k_proj.weight", 2), 1);
        assert_eq!(split.shared_part("attn.k_proj.weight", 2), None);
        let whole = TpPlan::new(&rules, 3, 4);
        assert_eq!(whole.replicas("attn.q_proj.weight", 2), 4);
        assert!(!whole.holds_first_copy("attn.q_proj.weight", 2));

        let model = params(&[("attn.k_proj.weight", &[6, 8])]);
        assert_eq!(TpPlan::new(&rules, 0, 4).check(&model), Ok(()));
        let error = TpPlan::new(&rules, 0, 3).check(&model).unwrap_err();
        assert_eq!(
            error.to_string(),
            "parameter `attn.k_proj.weight` holds 2 heads, which cannot be split over 3 ranks: \
             each rank holds whole heads (tp dividing the heads) or one head shared with other \
             ranks (the heads dividing tp), and neither 2 nor 3 divides the other"
        );
    }

    fn params(list: &[(&str, &[usize])]) -> Vec<(String, Vec<usize>)> {
        list.iter()
            .map(|(path, shape)| (path.to_string(), shape.to_vec()))
            .collect()
    }

    /// A rule that matches nothing, a parameter two rules match, a split that does not divide,
    /// and a split of a parameter that is no matrix are refused, naming the path and sizes.
    #[test]
    fn a_plan_that_does_not_fit_is_refused_naming_path_and_sizes() {
        let model = params(&[
            ("blocks.0.attn.c_attn.weight", &[8, 24]),
            ("blocks.0.attn.c_attn.bias", &[24]),
            ("blocks.0.attn.c_proj.weight", &[8, 8]),
            ("head.wte", &[77, 8]),
            ("blocks.0.ln_1.gamma", &[8]),
            ("blocks.0.attn.q_norm.gamma", &[4]),
        ]);
        assert_eq!(TpPlan::new(PLAN, 0, 2).check(&model), Ok(()));
        // 77 rows at tp 4: the vocabulary splits unevenly, which is allowed.
        assert_eq!(TpPlan::new(PLAN, 0, 4).check(&model), Ok(()));

        let missing = [("blocks.*.mlp.c_fc", TpStyle::COLUMN)];
        let error = TpPlan::new(&missing, 0, 2).check(&model).unwrap_err();
        assert!(matches!(&error, PlanError::NoMatch { rule, .. } if rule == "blocks.*.mlp.c_fc"));
        assert!(error.to_string().contains("`blocks.0.attn.c_attn.weight`"));

        let twice = [
            ("blocks.*.attn.c_proj", TpStyle::Row),
            ("blocks.0.attn.*", TpStyle::Replicated),
        ];
        let error = TpPlan::new(&twice, 0, 2).check(&model).unwrap_err();
        assert!(matches!(error, PlanError::Ambiguous { ref path, .. }
            if path == "blocks.0.attn.c_proj.weight"));

        // 24 columns in 3 sections of 8 do not split over 3 ranks.
        let error = TpPlan::new(PLAN, 0, 3).check(&model).unwrap_err();
        assert_eq!(
            error.to_string(),
            "parameter `blocks.0.attn.c_attn.weight` of shape [8, 24] cannot be split \
             column-parallel in 3 sections over 3 ranks: dimension 1 holds 24 entries, not a \
             multiple of 9"
        );

        let cube = params(&[("conv.weight", &[2, 2, 2])]);
        let error = TpPlan::new(&[("conv", TpStyle::Row)], 0, 2).check(&cube);
        assert!(matches!(error, Err(PlanError::WrongRank { .. })));
    }
}
