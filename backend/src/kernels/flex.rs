//! The fused ops as native code on Flex, Burn's CPU backend: what `Parallel<Flex>` runs for
//! fused attention, the fused bias + GELU and the fused LayerNorm in f32, on rayon's threads.
//! The reference in Burn tensor ops computes the same values one Flex op at a time (most of
//! them on one thread, each writing a new tensor); these read the inputs in place and keep
//! only a tile of scores.
//!
//! **Attention**, per head of `[batch, heads, seq, d]` f32 inputs (the GPT's heads are a strided
//! view of its qkv projection, read as they lie), in tiles of `QUERY_TILE` (32) queries, with
//! `c = 1/√d`, `K, V` the keys the tile's last query sees (`0..end`; all of them, or up to the
//! tile's end when causal) and `M` the causal mask inside the tile. The products are Flex's own
//! matmul kernels (the `gemm` crate) on one thread each:
//!
//! - forward, tiles in parallel (a batch entry's tile of positions, all its heads): `S = c·Q_t
//!   Kᵀ`, per row `m = max S`, `P = e^(S − m)` (0 under `M`), `ℓ = Σ P`; then `O_t = (P V) / ℓ`
//!   and `L = m + ln ℓ`: FlashAttention-2's output and logsumexp, with the whole softmax row in
//!   the tile (a tile of scores is `32 × seq`, never `seq × seq`), written positions first so
//!   that merging the heads costs no copy;
//! - backward, heads in parallel (a head's dK and dV gather over its tiles), from the saved
//!   `L`: `P = e^(c·Q_t Kᵀ − L)` (0 under `M`), `dV += Pᵀ dO_t`, `dP = dO_t Vᵀ`,
//!   `Δ = rowsum(P ∘ dP)` (= `dO·O`, from the tile rather than the output),
//!   `dS = c·P ∘ (dP − Δ)`, `dQ_t = dS K`, `dK += dSᵀ Q_t`.
//!
//! **Bias + GELU**: `y = g(x + b)` and `dx = dy ∘ g'(x + b)` elementwise, rows in parallel, with
//! [`super::bias_gelu`]'s `g` and `g'` (the clamped exponent included).
//!
//! **LayerNorm**: [`super::layer_norm`]'s forward and backward, one pass over each row (two for
//! its statistics), rows in parallel.
//!
//! The exponentials (softmax and GELU) are [`exp`], arithmetic the compiler vectorises, in loops
//! compiled for the CPU's widest SIMD (AVX-512 or AVX2, chosen at run time by [`vectorised`]).
//!
//! Inputs of another type (f16, bf16) run the reference.

use burn::tensor::{DType, Shape, TensorData};
use std::mem::MaybeUninit;

use burn_flex::FlexTensor;
use rayon::prelude::*;

use super::{GELU_A, GELU_C, GELU_EXPONENT_CLAMP};

/// Query rows per tile of the attention: a task of the forward, a step of the backward.
const QUERY_TILE: usize = 32;

/// `tensor`'s f32 elements with every stride non-negative: the tensor as it is when it already
/// lies so, or a contiguous copy.
fn readable_f32(tensor: FlexTensor) -> Option<FlexTensor> {
    if tensor.dtype() != DType::F32 {
        return None;
    }
    Some(match tensor.layout().has_positive_strides() {
        true => tensor,
        false => tensor.to_contiguous(),
    })
}

/// A strided f32 matrix in a slice: element `(r, c)` at `offset + r·row_stride + c·col_stride`.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    offset: usize,
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> View<'a> {
    /// `rows × cols` row-major at the start of `data`.
    fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self {
            data,
            offset: 0,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose (no copy).
    fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// Element `(r, c)`.
    fn at(&self, r: usize, c: usize) -> f32 {
        self.data[self.offset + r * self.row_stride + c * self.col_stride]
    }

    /// Every element lies inside `data`.
    fn in_bounds(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || self.offset + (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride
                < self.data.len()
    }
}

/// `dst = scale·lhs·rhs`, or `dst += scale·lhs·rhs` when `accumulate`; `dst` is row-major
/// `[lhs.rows, rhs.cols]` in a slice, its rows `dst_stride` apart. Flex's own matmul kernels
/// (the `gemm` crate, which picks the CPU's widest vectors at run time), on one thread.
///
/// # Panics
/// When the shapes do not chain or a matrix leaves its slice.
fn gemm_into(
    dst: &mut [f32],
    dst_stride: usize,
    lhs: View,
    rhs: View,
    scale: f32,
    accumulate: bool,
) {
    let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
    assert_eq!(k, rhs.rows, "gemm_into: {m}×{k} by {}×{n}", rhs.rows);
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * dst_stride + n <= dst.len() && n <= dst_stride);
    assert!(lhs.in_bounds() && rhs.in_bounds());
    if k == 0 {
        if !accumulate {
            dst.chunks_mut(dst_stride)
                .take(m)
                .for_each(|row| row[..n].fill(0.0));
        }
        return;
    }
    let stride = |s: usize| s as isize;
    // SAFETY: the three matrices lie inside their slices (asserted above), `dst` is borrowed
    // mutably and the inputs shared, so nothing the call writes is read through another path.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            stride(dst_stride),
            accumulate,
            lhs.data.as_ptr().add(lhs.offset),
            stride(lhs.col_stride),
            stride(lhs.row_stride),
            rhs.data.as_ptr().add(rhs.offset),
            stride(rhs.col_stride),
            stride(rhs.row_stride),
            1.0,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// The heads of a rank-4 f32 tensor `[batch, heads, seq, d]`, read where they lie.
struct Heads<'a> {
    data: &'a [f32],
    start: usize,
    /// Strides of batch, head, position and column.
    strides: [usize; 4],
    heads: usize,
    d: usize,
}

impl<'a> Heads<'a> {
    /// `tensor` (as [`readable_f32`] leaves it) read by heads.
    fn of(tensor: &'a FlexTensor) -> Self {
        let layout = tensor.layout();
        let stride = |dim: usize| layout.strides()[dim] as usize;
        Self {
            data: tensor.storage::<f32>(),
            start: layout.start_offset(),
            strides: [stride(0), stride(1), stride(2), stride(3)],
            heads: layout.shape()[1],
            d: layout.shape()[3],
        }
    }

    /// Rows `first..first + rows` of head `head` (heads counted over the batch:
    /// `b·heads + h`), as a `rows × d` matrix.
    fn rows(&self, head: usize, first: usize, rows: usize) -> View<'a> {
        let [batch_stride, head_stride, position_stride, column_stride] = self.strides;
        View {
            data: self.data,
            offset: self.start
                + (head / self.heads) * batch_stride
                + (head % self.heads) * head_stride
                + first * position_stride,
            rows,
            cols: self.d,
            row_stride: position_stride,
            col_stride: column_stride,
        }
    }
}

/// How many keys query `position` of `seq` sees: `position + 1` when causal, all otherwise.
fn keys_seen(position: usize, seq: usize, causal: bool) -> usize {
    if causal { position + 1 } else { seq }
}

fn tensor_f32(values: Vec<f32>, shape: Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// `len` new f32 written in parallel by `fill(index, part)`, one call per part of `chunk`
/// elements (the last may be shorter), and what each call returned, in order. The memory is
/// not zeroed first: `vec![0.0; len]` would cost one more pass over it, on the calling thread.
///
/// # Safety
/// `fill` must write every element of its part (`MaybeUninit::write`) before it returns.
unsafe fn par_written<R: Send>(
    len: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) -> R + Sync,
) -> (Vec<f32>, Vec<R>) {
    let mut values = Vec::with_capacity(len);
    let returned = values.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk.max(1))
        .enumerate()
        .map(|(index, part)| fill(index, part))
        .collect();
    // SAFETY: the capacity is `len`, and `fill` wrote every element below it (the caller's
    // promise); a panic in `fill` leaves the length 0.
    unsafe { values.set_len(len) };
    (values, returned)
}

/// A tile of `rows` queries from `first` and the keys they see, `0..end`.
#[derive(Clone, Copy)]
struct Tile {
    first: usize,
    rows: usize,
    end: usize,
}

impl Tile {
    fn new(index: usize, seq: usize, causal: bool) -> Self {
        let first = index * QUERY_TILE;
        let rows = QUERY_TILE.min(seq - first);
        Self {
            first,
            rows,
            end: keys_seen(first + rows - 1, seq, causal),
        }
    }

    /// The tile's scores `c·Q_tile·Kᵀ` into `scores` (`rows × end`, row-major).
    fn scores(&self, q: &Heads, k: &Heads, head: usize, scale: f32, scores: &mut [f32]) {
        let (queries, keys) = (
            q.rows(head, self.first, self.rows),
            k.rows(head, 0, self.end),
        );
        gemm_into(scores, self.end, queries, keys.t(), scale, false);
    }

    /// Each score row's keys past what its query sees (under the causal mask) set to 0, and
    /// `f(row, seen)` on the keys it sees.
    fn each_row(
        &self,
        scores: &mut [f32],
        seq: usize,
        causal: bool,
        mut f: impl FnMut(usize, &mut [f32]),
    ) {
        for (r, row) in scores.chunks_mut(self.end).take(self.rows).enumerate() {
            let (seen, hidden) = row.split_at_mut(keys_seen(self.first + r, seq, causal));
            hidden.fill(0.0);
            f(r, seen);
        }
    }
}

/// The query's shape when the loops take `inputs` (query, key, value, …): rank 4, not empty,
/// key and value (and the output and its gradient, when given) of the query's shape.
fn taken_attention_shape(inputs: &[FlexTensor]) -> Option<Shape> {
    let shape = inputs[0].layout().shape();
    let alike = |i: usize| inputs.get(i).is_none_or(|t| t.layout().shape() == shape);
    let taken =
        shape.num_dims() == 4 && shape.num_elements() > 0 && [1, 2, 3, 5].into_iter().all(alike);
    taken.then(|| shape.clone())
}

/// The attention forward (see the module doc): the output `[batch, heads, seq, d]` and the
/// logsumexp `[batch, heads, seq]`, or `None` for inputs it does not take (not all f32, not
/// one non-empty `[batch, heads, seq, d]` shape).
///
/// Both are written positions first, `[batch, seq, heads, ·]`, and returned as views with the
/// heads and positions swapped: the output is then already the `[batch, seq, heads·d]` a
/// model merges its heads into, and that merge is a reshape, not a copy. Tasks are a batch
/// entry's tile of positions, all heads.
pub fn attention_forward(inputs: [FlexTensor; 3], causal: bool) -> Option<[FlexTensor; 2]> {
    let shape = taken_attention_shape(&inputs)?;
    let [query, key, value] = inputs.map(readable_f32);
    let (query, key, value) = (query?, key?, value?);
    let (q, k, v) = (Heads::of(&query), Heads::of(&key), Heads::of(&value));
    let [batch, heads, seq, d] = shape.dims::<4>();
    let scale = 1.0 / (d as f32).sqrt();
    let mut output = vec![0.0f32; shape.num_elements()];
    let mut logsumexp = vec![0.0f32; batch * heads * seq];
    let row = heads * d;
    output
        .par_chunks_mut(seq * row)
        .zip(logsumexp.par_chunks_mut(seq * heads))
        .enumerate()
        .for_each(|(b, (batch_output, batch_lse))| {
            batch_output
                .par_chunks_mut(QUERY_TILE * row)
                .zip(batch_lse.par_chunks_mut(QUERY_TILE * heads))
                .enumerate()
                .for_each(|(index, (out, lse))| {
                    let tile = Tile::new(index, seq, causal);
                    let mut probs = vec![0.0f32; tile.rows * tile.end];
                    for h in 0..heads {
                        let head = b * heads + h;
                        tile.scores(&q, &k, head, scale, &mut probs);
                        let mut row_sums = [0.0f32; QUERY_TILE];
                        tile.each_row(&mut probs, seq, causal, |r, seen| {
                            let max = seen.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                            exp_shifted(seen, max);
                            row_sums[r] = seen.iter().sum();
                            lse[r * heads + h] = max + row_sums[r].ln();
                        });
                        let p = View::row_major(&probs, tile.rows, tile.end);
                        let values = v.rows(head, 0, tile.end);
                        gemm_into(&mut out[h * d..], row, p, values, 1.0, false);
                        for (r, sum) in row_sums.iter().take(tile.rows).enumerate() {
                            let start = r * row + h * d;
                            out[start..start + d].iter_mut().for_each(|o| *o /= sum);
                        }
                    }
                });
        });
    let positions_first =
        |values, dims: &[usize]| tensor_f32(values, Shape::from(dims.to_vec())).transpose(1, 2);
    Some([
        positions_first(output, &[batch, seq, heads, d]),
        positions_first(logsumexp, &[batch, seq, heads]),
    ])
}

/// The attention backward (see the module doc) from `[query, key, value, output, logsumexp,
/// output_grad]` (the output is not read: `Δ` comes from the tile), the gradients of query, key
/// and value, or `None` for inputs it does not take (as the forward's).
pub fn attention_backward(inputs: [FlexTensor; 6], causal: bool) -> Option<[FlexTensor; 3]> {
    let shape = taken_attention_shape(&inputs)?;
    let [query, key, value, _output, logsumexp, output_grad] = inputs.map(readable_f32);
    let (query, key, value, output_grad) = (query?, key?, value?, output_grad?);
    let logsumexp = logsumexp?.to_contiguous();
    let (q, k, v) = (Heads::of(&query), Heads::of(&key), Heads::of(&value));
    let grad = Heads::of(&output_grad);
    let lse = logsumexp.as_slice::<f32>()?;
    let [_, _, seq, d] = shape.dims::<4>();
    let scale = 1.0 / (d as f32).sqrt();
    let [mut dq, mut dk, mut dv] = [(); 3].map(|_| vec![0.0f32; shape.num_elements()]);
    dq.par_chunks_mut(seq * d)
        .zip(dk.par_chunks_mut(seq * d))
        .zip(dv.par_chunks_mut(seq * d))
        .enumerate()
        .for_each(|(head, ((dq, dk), dv))| {
            let mut probs = vec![0.0f32; QUERY_TILE * seq];
            let mut score_grads = vec![0.0f32; QUERY_TILE * seq];
            for index in 0..seq.div_ceil(QUERY_TILE) {
                let tile = Tile::new(index, seq, causal);
                let queries = q.rows(head, tile.first, tile.rows);
                let grads = grad.rows(head, tile.first, tile.rows);
                let (keys, values) = (k.rows(head, 0, tile.end), v.rows(head, 0, tile.end));
                let size = tile.rows * tile.end;
                let (probs, score_grads) = (&mut probs[..size], &mut score_grads[..size]);
                // P = e^(c·QKᵀ − L), dV += Pᵀ dO.
                tile.scores(&q, &k, head, scale, probs);
                tile.each_row(probs, seq, causal, |r, seen| {
                    exp_shifted(seen, lse[head * seq + tile.first + r]);
                });
                let p = View::row_major(probs, tile.rows, tile.end);
                gemm_into(dv, d, p.t(), grads, 1.0, true);
                // dS = c·P ∘ (dP − Δ), dP = dO Vᵀ, Δᵢ = Σⱼ Pᵢⱼ dPᵢⱼ.
                gemm_into(score_grads, tile.end, grads, values.t(), 1.0, false);
                for (ds, p) in score_grads.chunks_mut(tile.end).zip(probs.chunks(tile.end)) {
                    let delta: f32 = ds.iter().zip(p).map(|(dp, p)| dp * p).sum();
                    for (ds, p) in ds.iter_mut().zip(p) {
                        *ds = scale * p * (*ds - delta);
                    }
                }
                // dQ = dS K, dK += dSᵀ Q.
                let ds = View::row_major(score_grads, tile.rows, tile.end);
                gemm_into(&mut dq[tile.first * d..], d, ds, keys, 1.0, false);
                gemm_into(dk, d, ds.t(), queries, 1.0, true);
            }
        });
    Some([dq, dk, dv].map(|values| tensor_f32(values, shape.clone())))
}

/// Q's, K's and V's `[batch, heads, seq, d]` f32 (their gradients) in one `[batch, seq,
/// 3·heads, d]`: [`super::attention::pack`] as one pass of row copies, positions in parallel, or
/// `None` for inputs it does not take (as the attention's).
pub fn pack_heads(sections: [FlexTensor; 3]) -> Option<[FlexTensor; 1]> {
    let shape = taken_attention_shape(&sections)?;
    let [q, k, v] = sections.map(readable_f32);
    let (q, k, v) = (q?, k?, v?);
    let sources = [Heads::of(&q), Heads::of(&k), Heads::of(&v)];
    let [batch, heads, seq, d] = shape.dims::<4>();
    // SAFETY: a part is one position's `3·heads` rows of `d`, each element written once.
    let (packed, _) = unsafe {
        par_written(3 * shape.num_elements(), 3 * heads * d, |position, rows| {
            let (b, t) = (position / seq, position % seq);
            for (row, packed_row) in rows.chunks_mut(d).enumerate() {
                let (section, h) = (row / heads, row % heads);
                let source = sources[section].rows(b * heads + h, t, 1);
                for (c, value) in packed_row.iter_mut().enumerate() {
                    value.write(source.at(0, c));
                }
            }
        })
    };
    Some([tensor_f32(packed, Shape::new([batch, seq, 3 * heads, d]))])
}

/// `e^x` in f32, within 2 ulp, in arithmetic a loop over it vectorises into (the C library's
/// `expf` is one call per element): `x = n·ln 2 + r` with `n` the integer nearest `x·log₂e` and
/// `|r| ≤ ln 2 / 2`; `e^r` by its Taylor polynomial to degree 7 (remainder under 2⁻²⁷ relative);
/// `2ⁿ` written as float bits. `n` is read off the bits of `x·log₂e + 1.5·2²³`, whose rounding
/// is to the nearest integer, so no float-to-integer conversion is needed. Results under e^−87
/// flush to 0 and over e^88 become +∞; NaN stays NaN.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const ROUNDER: f32 = 12_582_912.0;
    const LN2_HIGH: f32 = 0.693_145_75;
    const LN2_LOW: f32 = 1.428_606_8e-6;
    let (low, high) = (-87.0, 88.0);
    let clamped = if x < low {
        low
    } else if x > high {
        high
    } else {
        x
    };
    let shifted = clamped * std::f32::consts::LOG2_E + ROUNDER;
    let n = shifted - ROUNDER;
    // ln 2 in two parts (Cody and Waite), so `n·ln 2` loses no bits of `r`.
    let r = (clamped - n * LN2_HIGH) - n * LN2_LOW;
    let taylor = [720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0].map(|factorial| 1.0 / factorial);
    let e_r = taylor.into_iter().fold(1.0 / 5040.0, |p, c| p * r + c);
    let exponent_bits = shifted.to_bits().wrapping_sub(ROUNDER.to_bits());
    let two_n = f32::from_bits(exponent_bits.wrapping_add(127) << 23);
    if x < low {
        0.0
    } else if x > high {
        f32::INFINITY
    } else {
        e_r * two_n
    }
}

/// Runs `f` compiled for the widest SIMD the CPU has (AVX-512, else AVX2 with FMA, on x86-64;
/// `pulp`'s run-time dispatch), so that loops inlined into it vectorise to that width.
#[inline(always)]
pub(super) fn vectorised<R>(f: impl FnOnce() -> R) -> R {
    pulp::Arch::new().dispatch(f)
}

/// `v ← e^(v − shift)` for every element.
fn exp_shifted(values: &mut [f32], shift: f32) {
    vectorised(
        #[inline(always)]
        || values.iter_mut().for_each(|v| *v = exp(*v - shift)),
    );
}

/// GELU's exponent `E = −2c(z + a·z³)`, in f32 as the kernels compute it.
#[inline(always)]
fn gelu_exponent(z: f32) -> f32 {
    -2.0 * GELU_C as f32 * (z + GELU_A as f32 * z * z * z)
}

/// `g(z) = z / (1 + e^min(E, 80))`.
#[inline(always)]
fn gelu(z: f32) -> f32 {
    z / (1.0 + exp(gelu_exponent(z).min(GELU_EXPONENT_CLAMP as f32)))
}

/// `g'(z)` of the clamped form: `s + z·s(1 − s)·2c(1 + 3a·z²)` below the clamp, `s` at it.
#[inline(always)]
fn gelu_slope(z: f32) -> f32 {
    let exponent = gelu_exponent(z);
    let clamp = GELU_EXPONENT_CLAMP as f32;
    let s = 1.0 / (1.0 + exp(exponent.min(clamp)));
    if exponent < clamp {
        let growth = 1.0 + 3.0 * GELU_A as f32 * z * z;
        s + z * s * (1.0 - s) * 2.0 * GELU_C as f32 * growth
    } else {
        s
    }
}

/// Rows of `columns` elements per parallel task of the elementwise ops: about 64 Ki elements.
fn rows_per_task(columns: usize) -> usize {
    (65_536 / columns.max(1)).max(1)
}

/// `f(x[r, c] + b[c], other[r, c])` for every element of `x: [.., n]` (and of `other`, its
/// shape, when given), as a new f32 tensor of `x`'s shape; `None` unless all are f32, `n > 0`
/// and `b` is `[n]`.
fn biased_elementwise(
    x: FlexTensor,
    bias: FlexTensor,
    other: Option<FlexTensor>,
    f: impl Fn(f32, f32) -> f32 + Sync,
) -> Option<FlexTensor> {
    let shape = x.layout().shape().clone();
    let columns = shape[shape.num_dims() - 1];
    let bias_shape = bias.layout().shape();
    let fits = columns > 0
        && bias_shape.num_dims() == 1
        && bias_shape[0] == columns
        && other
            .as_ref()
            .is_none_or(|other| *other.layout().shape() == shape);
    if !fits {
        return None;
    }
    let contiguous = |t: FlexTensor| readable_f32(t).map(|t| t.to_contiguous());
    let (x, bias) = (contiguous(x)?, contiguous(bias)?);
    let other = match other {
        Some(other) => Some(contiguous(other)?),
        None => None,
    };
    let (xs, bs) = (x.as_slice::<f32>()?, bias.as_slice::<f32>()?);
    // Without `other`, `f` is given `x` again in its place, and ignores it.
    let others = match &other {
        Some(other) => other.as_slice::<f32>()?,
        None => xs,
    };
    let chunk = rows_per_task(columns) * columns;
    // SAFETY: a part is whole rows of `columns` (`chunk` is a multiple of it), and each row's
    // elements are zipped with the same row of `x`, of `other` and with `b`, all `columns` long.
    let (out, _) = unsafe {
        par_written(xs.len(), chunk, |index, out| {
            let rows = out
                .chunks_mut(columns)
                .zip(xs[index * chunk..].chunks(columns))
                .zip(others[index * chunk..].chunks(columns));
            vectorised(
                #[inline(always)]
                || {
                    for ((out, xs), others) in rows {
                        for (((y, x), b), o) in out.iter_mut().zip(xs).zip(bs).zip(others) {
                            y.write(f(x + b, *o));
                        }
                    }
                },
            );
        })
    };
    Some(tensor_f32(out, shape))
}

/// Elements per task of [`add`], and the fewest it takes for tensors of one shape: below two
/// tasks Flex's own add (in place when it can, on one thread) is as fast.
const ADD_TASK: usize = 1 << 16;

/// The shortest repeated operand [`add`] takes; Flex adds shorter ones (a scalar, a few
/// columns) well enough.
const MIN_PERIOD: usize = 64;

/// Whether adding `small` to `big` (of one rank) repeats `small` whole: `small` is `big`'s
/// shape with leading dims of 1 (none: the same shape).
fn repeats_along_leading(small: &Shape, big: &Shape) -> bool {
    let (small, big) = (small.as_slice(), big.as_slice());
    let first = small.iter().position(|&d| d != 1).unwrap_or(small.len());
    small.len() == big.len() && small[first..] == big[first..]
}

/// `lhs + rhs` for contiguous f32 tensors, on rayon's threads, where Flex's add is slow:
/// - tensors of one shape with at least `2·ADD_TASK` elements, on more than one thread (Flex
///   adds on one; on one thread its add, in place when it can, was as fast: tiny GPT 140
///   against 144 ms a step);
/// - one operand repeated along leading dims of 1 (a position embedding `[1, T, C]` on
///   `[B, T, C]`, a bias `[1, n]` on `[rows, n]`) of at least `MIN_PERIOD` elements: Flex walks
///   such a broadcast element by element.
///
/// `None` for other inputs. The sums are Flex's, bit for bit (one rounding each, and
/// `a + b = b + a`).
pub fn add([lhs, rhs]: [FlexTensor; 2]) -> Option<[FlexTensor; 1]> {
    let (lhs_shape, rhs_shape) = (lhs.layout().shape(), rhs.layout().shape());
    let (whole, repeated) = match repeats_along_leading(rhs_shape, lhs_shape) {
        true => (&lhs, &rhs),
        false => (&rhs, &lhs),
    };
    let (shape, period) = (
        whole.layout().shape().clone(),
        repeated.layout().num_elements(),
    );
    let taken = lhs.dtype() == DType::F32
        && rhs.dtype() == DType::F32
        && repeats_along_leading(repeated.layout().shape(), &shape)
        && match period == shape.num_elements() {
            true => period >= 2 * ADD_TASK && rayon::current_num_threads() > 1,
            false => period >= MIN_PERIOD,
        };
    if !taken {
        return None;
    }
    let (a, b) = (whole.as_slice::<f32>()?, repeated.as_slice::<f32>()?);
    // SAFETY: a part's elements are written in runs, each zipped with the same range of `a`
    // and a range of `b` of its length; the runs cover the part.
    let (sum, _) = unsafe {
        par_written(a.len(), ADD_TASK, |index, part| {
            let start = index * ADD_TASK;
            let mut done = 0;
            while done < part.len() {
                let offset = (start + done) % period;
                let run = (period - offset).min(part.len() - done);
                let a = &a[start + done..][..run];
                let b = &b[offset..][..run];
                vectorised(
                    #[inline(always)]
                    || {
                        for ((out, a), b) in part[done..done + run].iter_mut().zip(a).zip(b) {
                            out.write(a + b);
                        }
                    },
                );
                done += run;
            }
        })
    };
    Some([tensor_f32(sum, shape)])
}

/// `g(x + b)` on `x: [.., n]` and `b: [n]`, both f32.
pub fn bias_gelu_forward([x, bias]: [FlexTensor; 2]) -> Option<[FlexTensor; 1]> {
    biased_elementwise(x, bias, None, |z, _| gelu(z)).map(|y| [y])
}

/// `dx = dy ∘ g'(x + b)` from `[x, b, dy]`, all f32.
pub fn bias_gelu_backward([x, bias, output_grad]: [FlexTensor; 3]) -> Option<[FlexTensor; 1]> {
    biased_elementwise(x, bias, Some(output_grad), |z, dy| dy * gelu_slope(z)).map(|dx| [dx])
}

/// `x: [.., n]` and the `[n]` parameters `params` as contiguous f32 tensors, and `n`; `None`
/// unless all are f32, `n > 0`, every parameter is `[n]` and every `like_x` has `x`'s shape.
fn rows_and_parameters<const P: usize, const L: usize>(
    x: FlexTensor,
    params: [FlexTensor; P],
    like_x: [FlexTensor; L],
) -> Option<(FlexTensor, [FlexTensor; P], [FlexTensor; L], usize)> {
    let shape = x.layout().shape().clone();
    let columns = shape[shape.num_dims() - 1];
    let fits = columns > 0
        && params
            .iter()
            .all(|p| *p.layout().shape() == Shape::new([columns]))
        && like_x.iter().all(|t| *t.layout().shape() == shape);
    if !fits {
        return None;
    }
    let contiguous = |t: FlexTensor| readable_f32(t).map(|t| t.to_contiguous());
    let x = contiguous(x)?;
    let params = params.map(contiguous);
    let like_x = like_x.map(contiguous);
    if params.iter().chain(&like_x).any(Option::is_none) {
        return None;
    }
    Some((
        x,
        params.map(Option::unwrap),
        like_x.map(Option::unwrap),
        columns,
    ))
}

/// `Σ f(aᵢ, bᵢ)` over two slices of one length, accumulated in 16 lanes so that the loop
/// vectorises (a single running sum would fix the order of the additions), then summed.
#[inline(always)]
fn lane_sum(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    const LANES: usize = 16;
    let mut lanes = [0.0f32; LANES];
    let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let rest: f32 = (a_chunks.remainder().iter().zip(b_chunks.remainder()))
        .map(|(&a, &b)| f(a, b))
        .sum();
    for (a, b) in a_chunks.zip(b_chunks) {
        for k in 0..LANES {
            lanes[k] += f(a[k], b[k]);
        }
    }
    lanes.iter().sum::<f32>() + rest
}

/// A row's mean `μ` and `r = 1/√(σ² + ε)`, the variance around the mean (two passes).
#[inline(always)]
fn row_statistics(x: &[f32], epsilon: f32) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = lane_sum(x, x, |v, _| v) / n;
    let variance = lane_sum(x, x, |v, _| (v - mean) * (v - mean)) / n;
    (mean, 1.0 / (variance + epsilon).sqrt())
}

/// LayerNorm's forward ([`super::layer_norm`]), `x̂ ∘ γ + β`, from `[x, γ, β]`, all f32, rows
/// in parallel; `None` for inputs it does not take.
pub fn layer_norm_forward(
    [x, gamma, beta]: [FlexTensor; 3],
    epsilon: f64,
) -> Option<[FlexTensor; 1]> {
    let (x, [gamma, beta], [], columns) = rows_and_parameters(x, [gamma, beta], [])?;
    let (xs, gamma, beta) = (
        x.as_slice::<f32>()?,
        gamma.as_slice::<f32>()?,
        beta.as_slice::<f32>()?,
    );
    let epsilon = epsilon as f32;
    let chunk = rows_per_task(columns) * columns;
    // SAFETY: a part is whole rows, each zipped with its row of `x` and with `γ` and `β`, all
    // `columns` long.
    let (out, _) = unsafe {
        par_written(xs.len(), chunk, |index, out| {
            let rows = out
                .chunks_mut(columns)
                .zip(xs[index * chunk..].chunks(columns));
            vectorised(
                #[inline(always)]
                || {
                    for (out, x) in rows {
                        let (mean, r) = row_statistics(x, epsilon);
                        for (((y, x), g), b) in out.iter_mut().zip(x).zip(gamma).zip(beta) {
                            y.write((x - mean) * r * g + b);
                        }
                    }
                },
            )
        })
    };
    Some([tensor_f32(out, x.layout().shape().clone())])
}

/// LayerNorm's backward ([`super::layer_norm`]) from `[x, γ, dy]`, all f32: `[dx, dγ, dβ]`.
/// Rows in parallel, each task summing its rows' `dγ` and `dβ`; the tasks' sums are added in
/// task order, so the result does not depend on the number of threads. `None` for inputs it
/// does not take.
pub fn layer_norm_backward(
    [x, gamma, output_grad]: [FlexTensor; 3],
    epsilon: f64,
) -> Option<[FlexTensor; 3]> {
    let (x, [gamma], [output_grad], columns) = rows_and_parameters(x, [gamma], [output_grad])?;
    let (xs, gamma, dys) = (
        x.as_slice::<f32>()?,
        gamma.as_slice::<f32>()?,
        output_grad.as_slice::<f32>()?,
    );
    let (epsilon, n) = (epsilon as f32, columns as f32);
    let chunk = rows_per_task(columns) * columns;
    // SAFETY: a part is whole rows, each zipped with its rows of `x` and `dy`, with `g` and
    // `x̂` (all `columns` long).
    let (dx, partial_sums) = unsafe {
        par_written(xs.len(), chunk, |index, dx| {
            let [mut gamma_grad, mut beta_grad, mut normalised, mut g] =
                [(); 4].map(|_| vec![0.0f32; columns]);
            let (xs, dys) = (&xs[index * chunk..], &dys[index * chunk..]);
            vectorised(
                #[inline(always)]
                || {
                    let rows = dx.chunks_mut(columns).zip(xs.chunks(columns));
                    for ((dx, x), dy) in rows.zip(dys.chunks(columns)) {
                        let (mean, r) = row_statistics(x, epsilon);
                        for (((x̂, gi), x), (dy, gamma)) in normalised
                            .iter_mut()
                            .zip(&mut g)
                            .zip(x)
                            .zip(dy.iter().zip(gamma))
                        {
                            *x̂ = (x - mean) * r;
                            *gi = dy * gamma;
                        }
                        let g_mean = lane_sum(&g, &g, |v, _| v) / n;
                        let g_normalised_mean = lane_sum(&g, &normalised, |v, x̂| v * x̂) / n;
                        for ((dx, gi), x̂) in dx.iter_mut().zip(&g).zip(&normalised) {
                            dx.write(r * (gi - g_mean - x̂ * g_normalised_mean));
                        }
                        let sums = gamma_grad.iter_mut().zip(&mut beta_grad);
                        for (((dg, db), dy), x̂) in sums.zip(dy).zip(&normalised) {
                            *dg += dy * x̂;
                            *db += dy;
                        }
                    }
                },
            );
            [gamma_grad, beta_grad]
        })
    };
    let [mut gamma_grad, mut beta_grad] = [(); 2].map(|_| vec![0.0f32; columns]);
    for [dg, db] in partial_sums {
        gamma_grad.iter_mut().zip(dg).for_each(|(sum, v)| *sum += v);
        beta_grad.iter_mut().zip(db).for_each(|(sum, v)| *sum += v);
    }
    let parameter = |values| tensor_f32(values, Shape::new([columns]));
    Some([
        tensor_f32(dx, x.layout().shape().clone()),
        parameter(gamma_grad),
        parameter(beta_grad),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `exp` within 2 ulp of e^x over its whole range (about 240,000 points, both ends
    /// included), through `exp_shifted`'s vectorised loop as the kernels call it; and its ends:
    /// 0 below, +∞ above, NaN through.
    #[test]
    fn exp_is_within_two_ulp() {
        let points: Vec<f32> = (0..=240_000)
            .map(|i| -87.0 + 175.0 * i as f32 / 240_000.0)
            .collect();
        let mut values = points.clone();
        exp_shifted(&mut values, 0.0);
        for (x, got) in points.iter().zip(values) {
            let exact = f64::from(*x).exp();
            let ulps = (f64::from(got) - exact).abs() / (exact * f64::from(f32::EPSILON) / 2.0);
            assert!(ulps <= 2.0, "e^{x}: {got} for {exact} ({ulps:.2} ulp)");
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-88.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    /// `gemm_into` against the sum of products, on plain and transposed views, shapes with ones
    /// among them, writing and accumulating.
    #[test]
    fn gemm_into_matches_the_sum_of_products() {
        let values: Vec<f32> = (0..4096).map(|i| ((i * 37) % 23) as f32 - 11.0).collect();
        for (m, n, k) in [(1, 1, 1), (1, 32, 1), (1, 1, 32), (3, 5, 7), (32, 17, 64)] {
            for transposed in [false, true] {
                let lhs = match transposed {
                    false => View::row_major(&values, m, k),
                    true => View::row_major(&values, k, m).t(),
                };
                let rhs = View {
                    offset: 3,
                    ..View::row_major(&values, n, k).t()
                };
                for (accumulate, pad) in [(false, 0), (false, 2), (true, 0), (true, 2)] {
                    let stride = n + pad;
                    let mut dst = vec![1.0f32; m * stride];
                    gemm_into(&mut dst, stride, lhs, rhs, 0.5, accumulate);
                    for r in 0..m {
                        for c in 0..n {
                            let sum: f32 = (0..k).map(|i| lhs.at(r, i) * rhs.at(i, c)).sum();
                            let expected = 0.5 * sum + if accumulate { 1.0 } else { 0.0 };
                            let got = dst[r * stride + c];
                            assert_eq!(got, expected, "{m}×{n}×{k} t {transposed} at ({r}, {c})");
                        }
                        if pad > 0 {
                            assert_eq!(dst[r * stride + n], 1.0, "past the row");
                        }
                    }
                }
            }
        }
    }

    /// `add` sums bit for bit like Flex's own add over a tensor of several tasks (the last one
    /// short), on two threads, and with an operand repeated along a leading dim (either side,
    /// runs crossing the tasks' bounds), on one; and declines what it does not take: small
    /// tensors, short repeats, other shapes, strided views, same shapes on one thread.
    #[test]
    fn add_matches_flexs_add_and_declines_the_rest() {
        use burn::backend::Flex;
        use burn::tensor::{Distribution, Tensor};

        let device = Default::default();
        let len = 2 * ADD_TASK + 1000;
        let draw = |len: usize| {
            Tensor::<Flex, 1>::random([len], Distribution::Normal(0.0, 1.0), &device)
                .into_primitive()
                .tensor()
        };
        let (a, b) = (draw(len), draw(len));
        let pool = |threads| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
        };
        let inputs = || [a.clone(), b.clone()];
        assert!(pool(1).install(|| add(inputs())).is_none(), "one thread");
        let [sum] = pool(2).install(|| add(inputs())).expect("taken");
        let flex_sum = Tensor::<Flex, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(a))
            + Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(b));
        let bits = |t: FlexTensor| -> Vec<u32> {
            t.into_data()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(bits(sum), bits(flex_sum.into_primitive().tensor()));

        // A repeated operand, either side, on one thread too.
        let period = [1, 128, 192];
        let block = draw(128 * 192).reshape(Shape::new(period));
        let batch = draw(5 * 128 * 192).reshape(Shape::new([5, 128, 192]));
        let flex = |t: FlexTensor| {
            Tensor::<Flex, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(t))
        };
        let expected = bits(
            (flex(batch.clone()) + flex(block.clone()))
                .into_primitive()
                .tensor(),
        );
        for inputs in [[batch.clone(), block.clone()], [block, batch]] {
            let [sum] = pool(1).install(|| add(inputs)).expect("repeated, taken");
            assert_eq!(sum.layout().shape(), &Shape::new([5, 128, 192]));
            assert_eq!(bits(sum), expected, "a repeated operand");
        }

        let declined = |inputs| pool(2).install(|| add(inputs)).is_none();
        let scalar = || draw(1).reshape(Shape::new([1, 1]));
        assert!(
            declined([draw(len).reshape(Shape::new([len, 1])), scalar()]),
            "a scalar"
        );
        assert!(declined([draw(1000), draw(1000)]), "a small tensor");
        assert!(declined([draw(len), draw(len + 1)]), "shapes differ");
        let square = || draw(4 * ADD_TASK).reshape(Shape::new([512, 512]));
        assert!(
            declined([square().transpose(0, 1), square()]),
            "a transposed view"
        );
    }
}
