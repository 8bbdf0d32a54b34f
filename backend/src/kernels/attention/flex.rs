//! Fused attention as native loops on Flex in f32, per head of `[batch, heads, seq, d]` inputs
//! (the GPT's heads are a strided view of its qkv projection, read as they lie; keys and values
//! may have fewer heads, `kv_heads` dividing `heads`, query head `h` reading key/value head
//! `h / (heads / kv_heads)`: grouped-query attention without repeated copies), in tiles of
//! `QUERY_TILE` (32) queries, with `c = 1/√d`, `K, V` the keys the tile's last query sees
//! (`0..end`; all of them, or up to the tile's end when causal) and `M` the causal mask inside
//! the tile. The products are Flex's own matmul kernels (the `gemm` crate) on one thread each:
//!
//! - forward, tiles in parallel (a batch entry's tile of positions, all its heads): `S = c·Q_t
//!   Kᵀ`, per row `m = max S`, `P = e^(S − m)` (0 under `M`), `ℓ = Σ P`; then `O_t = (P V) / ℓ`
//!   and `L = m + ln ℓ`: FlashAttention-2's output and logsumexp, with the whole softmax row in
//!   the tile (a tile of scores is `32 × seq`, never `seq × seq`), written positions first so
//!   that merging the heads costs no copy;
//! - backward, key/value heads in parallel (a key/value head's dK and dV gather over the tiles
//!   of each query head of its group, in head order), from the saved
//!   `L`: `P = e^(c·Q_t Kᵀ − L)` (0 under `M`), `dV += Pᵀ dO_t`, `dP = dO_t Vᵀ`,
//!   `Δ = rowsum(P ∘ dP)` (= `dO·O`, from the tile rather than the output),
//!   `dS = c·P ∘ (dP − Δ)`, `dQ_t = dS K`, `dK += dSᵀ Q_t`.
//!
//! Inputs of another type (f16, bf16) run the reference.

use burn::tensor::Shape;
use burn_flex::FlexTensor;
use rayon::prelude::*;

use crate::kernels::flex::{View, exp_shifted, gemm_into, par_written, readable_f32, tensor_f32};

/// Query rows per tile of the attention: a task of the forward, a step of the backward.
const QUERY_TILE: usize = 32;

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

    /// The head of this tensor that query head `head` of `query_heads` reads (both counted
    /// over the batch): itself when the heads agree, else its group's key/value head.
    fn serving(&self, head: usize, query_heads: usize) -> usize {
        let group = query_heads / self.heads;
        (head / query_heads) * self.heads + (head % query_heads) / group
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

    /// The tile's scores `c·Q_tile·Kᵀ` of query head `head` into `scores` (`rows × end`,
    /// row-major).
    fn scores(&self, q: &Heads, k: &Heads, head: usize, scale: f32, scores: &mut [f32]) {
        let (queries, keys) = (
            q.rows(head, self.first, self.rows),
            k.rows(k.serving(head, q.heads), 0, self.end),
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

/// The query's and the key's shapes when the loops take `inputs` (query, key, value, …): rank
/// 4, not empty; value of the key's shape, and the key that of the query but for fewer heads
/// dividing the query's; the output and its gradient (when given) of the query's shape.
fn taken_attention_shapes(inputs: &[FlexTensor]) -> Option<[Shape; 2]> {
    let (shape, kv_shape) = (inputs[0].layout().shape(), inputs[1].layout().shape());
    let like = |i: usize, shape: &Shape| inputs.get(i).is_none_or(|t| t.layout().shape() == shape);
    let grouped = shape.num_dims() == 4
        && kv_shape.num_dims() == 4
        && kv_shape[1] > 0
        && shape[1].is_multiple_of(kv_shape[1])
        && [0, 2, 3].into_iter().all(|dim| kv_shape[dim] == shape[dim]);
    let taken = grouped
        && shape.num_elements() > 0
        && like(2, kv_shape)
        && [3, 5].into_iter().all(|i| like(i, shape));
    taken.then(|| [shape.clone(), kv_shape.clone()])
}

/// The attention forward (see the module doc): the output `[batch, heads, seq, d]` and the
/// logsumexp `[batch, heads, seq]`, or `None` for inputs it does not take (not all f32, not a
/// non-empty `[batch, heads, seq, d]` query with keys and values `[batch, kv_heads, seq, d]`,
/// `kv_heads` dividing `heads`).
///
/// Both are written positions first, `[batch, seq, heads, ·]`, and returned as views with the
/// heads and positions swapped: the output is then already the `[batch, seq, heads·d]` a
/// model merges its heads into, and that merge is a reshape, not a copy. Tasks are a batch
/// entry's tile of positions, all heads.
pub fn attention_forward(inputs: [FlexTensor; 3], causal: bool) -> Option<[FlexTensor; 2]> {
    let [shape, _] = taken_attention_shapes(&inputs)?;
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
                        let values = v.rows(v.serving(head, heads), 0, tile.end);
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
/// and value, or `None` for inputs it does not take (as the forward's). Tasks are a key/value
/// head with the query heads of its group.
pub fn attention_backward(inputs: [FlexTensor; 6], causal: bool) -> Option<[FlexTensor; 3]> {
    let [shape, kv_shape] = taken_attention_shapes(&inputs)?;
    let [query, key, value, _output, logsumexp, output_grad] = inputs.map(readable_f32);
    let (query, key, value, output_grad) = (query?, key?, value?, output_grad?);
    let logsumexp = logsumexp?.to_contiguous();
    let (q, k, v) = (Heads::of(&query), Heads::of(&key), Heads::of(&value));
    let grad = Heads::of(&output_grad);
    let lse = logsumexp.as_slice::<f32>()?;
    let [_, heads, seq, d] = shape.dims::<4>();
    let group = heads / kv_shape[1];
    let scale = 1.0 / (d as f32).sqrt();
    let mut dq = vec![0.0f32; shape.num_elements()];
    let [mut dk, mut dv] = [(); 2].map(|_| vec![0.0f32; kv_shape.num_elements()]);
    dq.par_chunks_mut(group * seq * d)
        .zip(dk.par_chunks_mut(seq * d))
        .zip(dv.par_chunks_mut(seq * d))
        .enumerate()
        .for_each(|(kv_head, ((dq, dk), dv))| {
            let mut probs = vec![0.0f32; QUERY_TILE * seq];
            let mut score_grads = vec![0.0f32; QUERY_TILE * seq];
            for (member, dq) in dq.chunks_mut(seq * d).enumerate() {
                let head = kv_head * group + member;
                for index in 0..seq.div_ceil(QUERY_TILE) {
                    let tile = Tile::new(index, seq, causal);
                    let queries = q.rows(head, tile.first, tile.rows);
                    let grads = grad.rows(head, tile.first, tile.rows);
                    let (keys, values) =
                        (k.rows(kv_head, 0, tile.end), v.rows(kv_head, 0, tile.end));
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
            }
        });
    Some([
        tensor_f32(dq, shape),
        tensor_f32(dk, kv_shape.clone()),
        tensor_f32(dv, kv_shape),
    ])
}

/// Q's, K's and V's `[batch, heads, seq, d]` f32 (their gradients) in one `[batch, seq,
/// 3·heads, d]`: [`super::pack`] as one pass of row copies, positions in parallel, or
/// `None` for inputs it does not take (as the attention's).
pub fn pack_heads(sections: [FlexTensor; 3]) -> Option<[FlexTensor; 1]> {
    let [shape, kv_shape] = taken_attention_shapes(&sections)?;
    if kv_shape != shape {
        return None;
    }
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
