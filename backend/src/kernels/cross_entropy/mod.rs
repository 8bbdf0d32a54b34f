//! The output head's loss without its logits tensor: the head's product and the cross-entropy
//! over blocks of rows, never holding the logits of more than one block (Liger's fused linear
//! cross-entropy, torchtitan's chunked loss).
//!
//! For hidden rows `x_i` (`[N, d]`), the head's weight `W` (`[V, d]` or `[d, V]`, see
//! [`HeadLayout`]) and targets `t_i`:
//!
//! ```text
//! L = Σ_i valid_i · (log Σ_j exp(x_i·w_j) − x_i·w_{t_i}),        valid_i = [t_i ≠ ignore index]
//! ```
//!
//! the summed token loss, as the recipe's decomposed loss computes it from the logits
//! ([`logits_cross_entropy_sum`]), ignored rows (PyTorch's `−100` by default) contributing
//! nothing. Callers divide by the step's count of unignored targets. A target is an id of the
//! vocabulary or the ignore index; nothing checks it on the device (that would read it back),
//! and another value scores as a row whose target logit is 0. Under tensor parallelism
//! each rank holds a part of the vocabulary ([`LinearCrossEntropy::with_vocab_shard`]) and the
//! softmax's row statistics are joined over the group (see [`chunks`]).
//!
//! **The gradients are computed in the forward.** The loss is a scalar, so whatever follows it,
//! `∂(anything)/∂x = g · ∂L/∂x` with `g` the scalar gradient arriving at `L`. The chunk loop,
//! which has each block's softmax at hand, computes `∂L/∂x` and `∂L/∂W` as it goes (f32, the
//! weight's summed over blocks); the backward only multiplies them by `g`. The alternative,
//! keeping each row's log-sum-exp and recomputing the head's product block by block in the
//! backward, does one product more (the head is about a tenth of GPT-2 small's FLOPs) to hold
//! `N` numbers instead of `∂L/∂W` between forward and backward. The head's backward needs
//! memory of `∂L/∂W`'s size either way, at the start of the backward pass, so both reach the
//! same peak; the forward-time gradients cost their size only where many forwards wait for
//! their backwards (GPipe's schedule, one copy per micro-batch in flight, where the decomposed
//! loss keeps a logits-sized tensor per micro-batch instead). Without a tracked input (an
//! evaluation) the loop computes the loss alone.
//!
//! **Memory.** Besides `∂L/∂W` and `∂L/∂x` (f32, the gradients the head's backward produces
//! anyway), a block of `C` rows holds about two `[C, V]` f32 tensors (three in half precision),
//! where the decomposed loss holds several `[N, V]` ones for the backward. `C` is chosen so that
//! a block's logits are at most [`CHUNK_ELEMENTS`] numbers (a multiple of 16 rows) but at least
//! [`MIN_CHUNK_ROWS`] rows, or set with [`LinearCrossEntropy::with_chunk_rows`].
//!
//! **Precision.** The products run in the inputs' type (f32, or bf16/f16 under mixed
//! precision, as the decomposed head's matmuls do), everything else in f32. In f16 the logits'
//! gradient is rounded to f16 before the backward's `g` (the loss scale) multiplies it, so
//! softmax probabilities below f16's smallest subnormal (`6·10⁻⁸`) drop out of the products,
//! as in Liger's fused loss; bf16 has f32's range.
//!
//! The ops are Burn's, so the loss runs on every backend; the backward is the autodiff node of
//! `Autodiff<Parallel<B>>` ([`FusedCrossEntropyBackend`]).

pub(crate) mod chunks;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{FloatDType, Int, Tensor, TensorMetadata};

use self::chunks::Wants;
use super::matmul::flex as matmul_flex;
use super::route::on_flex_owned;
use super::{cast_primitive, in_dtype, tensor};
use crate::Parallel;
use crate::collective::CollectiveBackend;
use crate::comm::{CommError, ProcessGroup};

/// PyTorch's ignore index: a target of this value contributes neither loss nor gradient.
pub const IGNORE_INDEX: i64 = -100;

/// The most logits a block of rows holds by default (16 MiB in f32).
pub const CHUNK_ELEMENTS: usize = 1 << 22;

/// The op name under which the weight gradient's products summed in place on Flex are counted
/// (`kernels::route`). Elsewhere the loss is Burn's ops by design, not a fallback, and is not
/// counted.
const ACCUMULATE: &str = "cross-entropy weight gradient";
/// The op name under which the backward's scaling of the gradients in place on Flex is
/// counted.
const SCALE: &str = "cross-entropy gradient scale";

/// The fewest rows a block has by default. Each block adds its product into the weight's
/// gradient, reading and writing all of it (`V·d` numbers) for `2·rows·V·d` FLOPs: with fewer
/// rows that traffic, not the product, sets the time (on the CPU, 32-row blocks made a Llama 3
/// vocabulary's loss 2× slower at width 2048 than the decomposed loss).
pub const MIN_CHUNK_ROWS: usize = 64;

/// How a head's weight holds the vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadLayout {
    /// `[V, d]`, one row per token: an embedding table (a tied head). Logits `x·Wᵀ`.
    VocabRows,
    /// `[d, V]`, one column per token: Burn's `Linear` weight (an untied head). Logits `x·W`.
    VocabColumns,
}

impl HeadLayout {
    /// The vocabulary (part) and the width of a weight of shape `dims`.
    fn vocab_and_width(self, [rows, columns]: [usize; 2]) -> (usize, usize) {
        match self {
            Self::VocabRows => (rows, columns),
            Self::VocabColumns => (columns, rows),
        }
    }

    fn vocab(self, dims: [usize; 2]) -> usize {
        self.vocab_and_width(dims).0
    }

    /// [`Self::logits`] of rows `x: [C, d]`, reading a `[V, d]` weight transposed where it lies
    /// (the rank-generic form reshapes the transposed view, a copy of the weight).
    fn row_logits<B: Backend>(self, x: Tensor<B, 2>, weight: Tensor<B, 2>) -> Tensor<B, 2> {
        match self {
            Self::VocabRows => x.matmul(weight.transpose()),
            Self::VocabColumns => x.matmul(weight),
        }
    }

    /// `x: [.., d]` → logits `[.., V]`.
    pub fn logits<B: Backend, const D: usize>(
        self,
        x: Tensor<B, D>,
        weight: Tensor<B, 2>,
    ) -> Tensor<B, D> {
        let weight = match self {
            Self::VocabRows => weight.transpose(),
            Self::VocabColumns => weight,
        };
        x.matmul(weight.unsqueeze())
    }

    /// The logits' gradient `g: [C, V]` → the input's, `[C, d]`.
    fn input_grad<B: Backend>(self, g: Tensor<B, 2>, weight: Tensor<B, 2>) -> Tensor<B, 2> {
        match self {
            Self::VocabRows => g.matmul(weight),
            Self::VocabColumns => g.matmul(weight.transpose()),
        }
    }

    /// `sum` (f32) plus the weight's gradient from the logits' gradient `g` and the input `x`
    /// ([`Self::weight_grad`]): on Flex in f32 summed in `sum`'s memory by the product itself,
    /// elsewhere the product cast to f32 and added.
    fn add_weight_grad<B: Backend>(
        self,
        sum: Tensor<B, 2>,
        g: Tensor<B, 2>,
        x: Tensor<B, 2>,
    ) -> Tensor<B, 2> {
        let (lhs, rhs) = match self {
            Self::VocabRows => (g.transpose(), x),
            Self::VocabColumns => (x.transpose(), g),
        };
        let inputs = [sum, lhs, rhs].map(|t| t.into_primitive().tensor());
        match on_flex_owned(ACCUMULATE, inputs, matmul_flex::accumulate) {
            Ok([sum]) => tensor(sum),
            Err([sum, lhs, rhs]) => {
                let product = tensor::<B, 2>(lhs).matmul(tensor(rhs));
                tensor::<B, 2>(sum) + in_dtype(product, FloatDType::F32)
            }
        }
    }

    /// The logits' gradient `g: [C, V]` and the input `x: [C, d]` → the weight's gradient, in
    /// the weight's layout.
    fn weight_grad<B: Backend>(self, g: Tensor<B, 2>, x: Tensor<B, 2>) -> Tensor<B, 2> {
        match self {
            Self::VocabRows => g.transpose().matmul(x),
            Self::VocabColumns => x.transpose().matmul(g),
        }
    }
}

/// This rank's part of a vocabulary split over `group`: columns `[start, start + V_r)` of the
/// whole logits, `V_r` the weight's vocabulary.
#[derive(Clone, Debug)]
pub struct VocabShard {
    pub group: ProcessGroup,
    pub start: usize,
}

/// The fused loss's settings: the ignore index, the block size and the vocabulary shard.
/// [`LinearCrossEntropy::loss_sum`] computes it.
#[derive(Clone, Debug)]
pub struct LinearCrossEntropy {
    ignore_index: i64,
    chunk_rows: Option<usize>,
    shard: Option<VocabShard>,
}

impl Default for LinearCrossEntropy {
    fn default() -> Self {
        Self::new()
    }
}

impl LinearCrossEntropy {
    /// Ignore index [`IGNORE_INDEX`], blocks of [`CHUNK_ELEMENTS`] logits, the whole vocabulary.
    pub fn new() -> Self {
        Self {
            ignore_index: IGNORE_INDEX,
            chunk_rows: None,
            shard: None,
        }
    }

    /// Targets equal to `index` contribute nothing.
    pub fn with_ignore_index(self, index: i64) -> Self {
        Self {
            ignore_index: index,
            ..self
        }
    }

    /// Blocks of `rows` rows.
    ///
    /// # Panics
    /// When `rows` is 0.
    pub fn with_chunk_rows(self, rows: usize) -> Self {
        assert!(
            rows > 0,
            "a block of the fused cross-entropy needs at least one row"
        );
        Self {
            chunk_rows: Some(rows),
            ..self
        }
    }

    /// The weight holds columns `[start, start + V_r)` of the vocabulary split over `group`;
    /// every rank of it calls the loss on the same rows and targets, and each gets the whole
    /// loss.
    pub fn with_vocab_shard(self, group: &ProcessGroup, start: usize) -> Self {
        Self {
            shard: Some(VocabShard {
                group: group.clone(),
                start,
            }),
            ..self
        }
    }

    /// The targets' ignore index.
    pub fn ignore_index(&self) -> i64 {
        self.ignore_index
    }

    /// Rows per block for a vocabulary (part) of `vocab` columns: as set, or the most whose
    /// logits stay within [`CHUNK_ELEMENTS`], rounded down to a multiple of 16, and at least
    /// [`MIN_CHUNK_ROWS`].
    pub fn rows_per_chunk(&self, vocab: usize) -> usize {
        self.chunk_rows.unwrap_or_else(|| {
            let rows = CHUNK_ELEMENTS / vocab.max(1) / 16 * 16;
            rows.max(MIN_CHUNK_ROWS)
        })
    }

    /// `L` (see the module doc) of `hidden: [.., d]` through `weight` (in `layout`) against
    /// `targets` of `hidden`'s leading shape: a one-element f32 tensor, the same on every rank
    /// of a vocabulary shard. Under a shard `hidden`'s gradient is this rank's part; the caller
    /// sums it over the group (pass `hidden` through `copy_to_parallel_region`, as a
    /// column-parallel layer's input).
    ///
    /// # Errors
    /// A collective of the shard's group that failed.
    ///
    /// # Panics
    /// When the shapes disagree (`hidden`'s width and the weight's, the targets' shape and
    /// `hidden`'s rows), the two differ in type, or a shard's part of the vocabulary is empty;
    /// the message names the values.
    pub fn loss_sum<B: FusedCrossEntropyBackend, const D: usize, const E: usize>(
        &self,
        hidden: Tensor<B, D>,
        weight: Tensor<B, 2>,
        layout: HeadLayout,
        targets: Tensor<B, E, Int>,
    ) -> Result<Tensor<B, 1>, CommError> {
        let (hidden_dims, weight_dims) = (hidden.dims(), weight.dims());
        let (vocab, width) = layout.vocab_and_width(weight_dims);
        assert!(
            D == E + 1 && hidden_dims[..E] == targets.dims()[..],
            "fused cross-entropy: hidden {hidden_dims:?} and targets {:?} (the targets must be \
             the hidden rows' leading shape)",
            targets.dims()
        );
        assert!(
            hidden_dims[D - 1] == width && vocab > 0,
            "fused cross-entropy: hidden {hidden_dims:?} and a {layout:?} weight \
             {weight_dims:?} (the weight needs the hidden width {} and at least one token)",
            hidden_dims[D - 1]
        );
        assert!(
            hidden.dtype() == weight.dtype(),
            "fused cross-entropy: hidden in {:?} and weight in {:?} (cast the weight to the \
             hidden rows' type)",
            hidden.dtype(),
            weight.dtype()
        );
        let rows = hidden_dims[..E].iter().product();
        let hidden = hidden.reshape([rows, width]).into_primitive().tensor();
        let targets = targets.reshape([rows]).into_primitive();
        let weight = weight.into_primitive().tensor();
        B::linear_cross_entropy(hidden, weight, layout, targets, self).map(tensor)
    }
}

/// A backend with the fused linear cross-entropy (see the module doc); on an autodiff backend
/// its backward scales the gradients the forward computed.
pub trait FusedCrossEntropyBackend: CollectiveBackend {
    /// `L` of `hidden: [N, d]` through `weight` in `layout` against `targets: [N]`, `[1]` f32.
    fn linear_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        layout: HeadLayout,
        targets: IntTensor<Self>,
        loss: &LinearCrossEntropy,
    ) -> Result<FloatTensor<Self>, CommError>;
}

impl<B: Backend> FusedCrossEntropyBackend for Parallel<B> {
    fn linear_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        layout: HeadLayout,
        targets: IntTensor<Self>,
        loss: &LinearCrossEntropy,
    ) -> Result<FloatTensor<Self>, CommError> {
        loss_alone::<B>([hidden, weight], layout, targets, loss)
    }
}

/// The loss of the block loop without gradients (an evaluation, or no autodiff).
fn loss_alone<B: Backend>(
    [hidden, weight]: [FloatTensor<Parallel<B>>; 2],
    layout: HeadLayout,
    targets: IntTensor<Parallel<B>>,
    loss: &LinearCrossEntropy,
) -> Result<FloatTensor<Parallel<B>>, CommError> {
    let (hidden, weight) = (tensor(hidden), tensor(weight));
    let targets = Tensor::from_primitive(targets);
    let out = chunks::run::<Parallel<B>>(hidden, weight, layout, targets, loss, Wants::NONE)?;
    Ok(out.loss.into_primitive().tensor())
}

/// The autodiff node of the fused loss: its state is the gradients the forward computed (f32),
/// which the backward multiplies by the loss's gradient and casts to the inputs' types.
#[derive(Debug)]
struct CrossEntropyBackward {
    /// The types of `[hidden, weight]`.
    dtypes: [FloatDType; 2],
}

impl<B: Backend> Backward<Parallel<B>, 2> for CrossEntropyBackward {
    type State = [Option<FloatTensor<Parallel<B>>>; 2];

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let loss_grad = grads.consume::<Parallel<B>>(&ops.node);
        for ((node, grad), dtype) in ops.parents.into_iter().zip(ops.state).zip(self.dtypes) {
            if let (Some(node), Some(grad)) = (node, grad) {
                let grad = scaled::<Parallel<B>>(grad, loss_grad.clone());
                grads.register::<Parallel<B>>(node.id, cast_primitive::<Parallel<B>>(grad, dtype));
            }
        }
    }
}

/// `grad · factor` for an f32 `grad` and the one-element `factor`: on Flex in `grad`'s own
/// memory (a weight's gradient is the size of the weight), elsewhere Burn's broadcast product.
fn scaled<B: Backend>(grad: FloatTensor<B>, factor: FloatTensor<B>) -> FloatTensor<B> {
    match on_flex_owned(SCALE, [grad, factor], super::flex::scale_in_place) {
        Ok([grad]) => grad,
        Err([grad, factor]) => {
            let factor = tensor::<B, 1>(factor).reshape([1, 1]);
            (tensor::<B, 2>(grad) * factor).into_primitive().tensor()
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> FusedCrossEntropyBackend for Autodiff<Parallel<B>, C> {
    fn linear_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        layout: HeadLayout,
        targets: IntTensor<Self>,
        loss: &LinearCrossEntropy,
    ) -> Result<FloatTensor<Self>, CommError> {
        let wants = Wants {
            hidden: !hidden.node.requirement.is_none(),
            weight: !weight.node.requirement.is_none(),
        };
        let dtypes = [&hidden, &weight].map(|t| FloatDType::from(t.primitive.dtype()));
        let nodes = [hidden.node.clone(), weight.node.clone()];
        let inputs = [hidden.primitive, weight.primitive];
        let node = CrossEntropyBackward { dtypes };
        Ok(match node.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let [hidden, weight] = inputs.map(tensor);
                let targets = Tensor::from_primitive(targets);
                let out = chunks::run::<Parallel<B>>(hidden, weight, layout, targets, loss, wants)?;
                let state = [out.hidden_grad, out.weight_grad]
                    .map(|grad| grad.map(|grad| grad.into_primitive().tensor()));
                prep.finish(state, out.loss.into_primitive().tensor())
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(loss_alone::<B>(inputs, layout, targets, loss)?)
            }
        })
    }
}

/// `ids` shifted into the part `[start, start + len)` of a vocabulary (ids outside it clamped
/// to a row of the part) and the float mask of those inside it: how a rank holding part of a
/// vocabulary looks up, or scores, ids it may not hold.
pub fn ids_in_part<B: Backend, const D: usize>(
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

/// The decomposed loss from whole logits: `Σ_i valid_i · −log softmax(logits_i)[t_i]` over
/// `logits: [N, V]` (any float type, computed in f32) and `targets: [N]`, targets equal to
/// `ignore_index` contributing nothing. What the fused loss replaces, and its reference.
pub fn logits_cross_entropy_sum<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    ignore_index: i64,
) -> Tensor<B, 1> {
    let vocab = logits.dims()[1];
    let logits = super::in_dtype(logits, FloatDType::F32);
    let valid = targets.clone().not_equal_elem(ignore_index).float();
    let (picked_ids, _) = ids_in_part(targets, 0, vocab);
    let picked = log_softmax(logits, 1).gather(1, picked_ids.unsqueeze_dim(1));
    (picked.squeeze_dim::<1>(1) * valid).sum().neg()
}

#[cfg(test)]
mod tests;
