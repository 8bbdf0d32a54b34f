//! FlashAttention-2 as CubeCL kernels, generic over the runtime (CUDA, wgpu), for f32, f16 and
//! bf16 inputs computed in f32. The math is the reference's ([`super`]); these are
//! its tiles written as kernels.
//!
//! Tensors are `[batch, heads, seq, d]`, made contiguous first. A cube owns `TILE` (32) rows of
//! one head and a unit owns one whole row: it holds the row's inputs and accumulators in arrays
//! of `d` (up to [`MAX_HEAD_DIM`]) f32, so every score is computed once, by the unit that needs
//! it, and the unit's own rows are read from memory once:
//!
//! - **forward** — a unit holds its query row `q` and walks the keys in tiles of `TILE`. It keeps
//!   the running max `m`, the running sum `l` and the unnormalised output `acc`; a tile with
//!   scores `s = c·q·kⱼ` (`c = 1/√d`) updates `m' = max(m, max s)`, `l' = l·e^(m−m') + Σ e^(s−m')`,
//!   `acc' = acc·e^(m−m') + Σ e^(s−m') vⱼ`. It writes `O = acc/l` and `L = m + ln l`. No `T×T`
//!   matrix exists anywhere.
//! - **backward** — with `Δᵢ = dOᵢ·Oᵢ` (one small kernel) and `Pᵢⱼ = e^(sᵢⱼ − Lᵢ)` recomputed
//!   from the saved `L`: `dVⱼ = Σᵢ Pᵢⱼ dOᵢ`, `dSᵢⱼ = Pᵢⱼ (dOᵢ·Vⱼ − Δᵢ)`, `dKⱼ = c Σᵢ dSᵢⱼ Qᵢ`,
//!   `dQᵢ = c Σⱼ dSᵢⱼ Kⱼ`. One kernel owns key rows (holds `kⱼ, vⱼ`, accumulates dK, dV, walking
//!   the queries), one owns query rows (holds `qᵢ, dOᵢ`, accumulates dQ, walking the keys);
//!   neither needs atomics.
//!
//! The other rows are read from global memory (cache), not staged in shared memory, and there
//! are no barriers: lavapipe compiles a compute shader as LLVM coroutines split at every
//! barrier, and took over a minute per kernel with them. Staging key tiles in shared memory and
//! tensor-core (`cmma`) inner products are what GPU throughput needs next.
//!
//! **Lavapipe's loop cap.** Lavapipe stops an invocation's loops once they have run 65535
//! iterations together ([`crate::kernels::route::LOOP_ITERATION_CAP`]), silently. The walks over a row's
//! `d` columns step by `UNROLL` (32) columns, unrolled, so the forward, the heavier, runs about
//! `(2⌈d/32⌉ + 2)·seq` iterations. On a wgpu device that may be lavapipe
//! ([`crate::kernels::route::loops_capped`]) the kernels decline shapes past the cap (lengths above about
//! 6400 at head dim 128, 16 000 at 32). Unrolling whole rows instead (a compile-time `d`)
//! would lift the cap to about 32 000 at any head dim, but lavapipe then took 40 s to compile the
//! kernels at head dim 32 and 4 minutes at 64.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::kernels::cube_kernel::{TensorSpec, unsupported_float};
use crate::kernels::launch::empty_on;
use crate::kernels::route::{LOOP_ITERATION_CAP, loops_capped};

/// A score below every real one: `e^(MASKED − m)` is 0 for any finite `m`.
const MASKED: f32 = -1.0e30;

/// Rows per cube, and keys per online-softmax step.
const TILE: usize = 32;

/// Columns per step of the loops over a row. The step is unrolled, so a row of `d` columns costs
/// `⌈d/UNROLL⌉` of the loop iterations lavapipe allows an invocation.
const UNROLL: usize = 32;

/// The largest head dim the kernels take.
pub const MAX_HEAD_DIM: usize = 256;

/// The length of the arrays a unit holds rows in: `d` rounded up to a whole step.
fn row_width(d: usize) -> usize {
    d.div_ceil(UNROLL) * UNROLL
}

/// The column read at position `c` of a row of `d`: `c`, or the last column for the padding past
/// `d` (held rows are zero there, and accumulators there are never stored).
#[cube]
fn column(c: usize, d: usize) -> usize {
    min(c, d - 1)
}

/// The row of `d` values of `src` from `start`, in f32, zero-padded to `width`.
#[cube]
fn load_row<F: Float>(
    src: &Tensor<F>,
    start: usize,
    d: usize,
    #[comptime] width: usize,
) -> Array<f32> {
    let mut row = Array::<f32>::new(width);
    for base in range_stepped(0, d, UNROLL) {
        #[unroll]
        for k in 0..UNROLL {
            let c = base + k;
            row[c] = select(c < d, f32::cast_from(src[start + column(c, d)]), 0.0f32);
        }
    }
    row
}

/// `width` zeros: an accumulator row.
#[cube]
fn zero_row(d: usize, #[comptime] width: usize) -> Array<f32> {
    let mut row = Array::<f32>::new(width);
    for base in range_stepped(0, d, UNROLL) {
        #[unroll]
        for k in 0..UNROLL {
            row[base + k] = 0.0;
        }
    }
    row
}

/// `held · src[start..start + d]`, in f32, in order of the columns.
#[cube]
fn dot_row<F: Float>(held: &Array<f32>, src: &Tensor<F>, start: usize, d: usize) -> f32 {
    let mut sum = 0.0f32;
    for base in range_stepped(0, d, UNROLL) {
        #[unroll]
        for k in 0..UNROLL {
            let c = base + k;
            sum += held[c] * f32::cast_from(src[start + column(c, d)]);
        }
    }
    sum
}

/// `(a · a_src[start..start + d], b · b_src[start..start + d])` in one walk over the columns.
#[cube]
fn dot_rows<F: Float>(
    a: &Array<f32>,
    a_src: &Tensor<F>,
    b: &Array<f32>,
    b_src: &Tensor<F>,
    start: usize,
    d: usize,
) -> (f32, f32) {
    let mut a_sum = 0.0f32;
    let mut b_sum = 0.0f32;
    for base in range_stepped(0, d, UNROLL) {
        #[unroll]
        for k in 0..UNROLL {
            let c = base + k;
            let source = start + column(c, d);
            a_sum += a[c] * f32::cast_from(a_src[source]);
            b_sum += b[c] * f32::cast_from(b_src[source]);
        }
    }
    (a_sum, b_sum)
}

/// `acc += factor · src[start..start + d]`.
#[cube]
fn add_row<F: Float>(acc: &mut Array<f32>, factor: f32, src: &Tensor<F>, start: usize, d: usize) {
    for base in range_stepped(0, d, UNROLL) {
        #[unroll]
        for k in 0..UNROLL {
            let c = base + k;
            acc[c] += factor * f32::cast_from(src[start + column(c, d)]);
        }
    }
}

/// `a += a_factor · a_src[start..start + d]` and `b += b_factor · b_src[start..start + d]` in one
/// walk over the columns.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_rows<F: Float>(
    a: &mut Array<f32>,
    a_factor: f32,
    a_src: &Tensor<F>,
    b: &mut Array<f32>,
    b_factor: f32,
    b_src: &Tensor<F>,
    start: usize,
    d: usize,
) {
    for base in range_stepped(0, d, UNROLL) {
        #[unroll]
        for k in 0..UNROLL {
            let c = base + k;
            let source = start + column(c, d);
            a[c] += a_factor * f32::cast_from(a_src[source]);
            b[c] += b_factor * f32::cast_from(b_src[source]);
        }
    }
}

/// `acc *= factor`.
#[cube]
fn scale_row(acc: &mut Array<f32>, factor: f32, d: usize) {
    for base in range_stepped(0, d, UNROLL) {
        #[unroll]
        for k in 0..UNROLL {
            acc[base + k] *= factor;
        }
    }
}

/// `dst[start..start + d] = factor · acc`.
#[cube]
fn store_row<F: Float>(dst: &mut Tensor<F>, acc: &Array<f32>, factor: f32, start: usize, d: usize) {
    for base in range_stepped(0, d, UNROLL) {
        #[unroll]
        for k in 0..UNROLL {
            let c = base + k;
            if c < d {
                dst[start + c] = F::cast_from(acc[c] * factor);
            }
        }
    }
}

/// The row this unit owns: row `UNIT_POS_X` of the cube's tile, or the last row for units past
/// the sequence end (they compute it again and write the same bits).
#[cube]
fn unit_row(seq: usize) -> usize {
    min(CUBE_POS_X as usize * TILE + UNIT_POS_X as usize, seq - 1)
}

/// Whether query `query` (a row below `seq`) sees key `key`.
#[cube]
fn visible(query: usize, key: usize, seq: usize, #[comptime] causal: bool) -> bool {
    let mut seen = key < seq;
    if causal {
        seen = seen && key <= query;
    }
    seen
}

/// The end of the keys a cube of queries starting at `first_query` sees.
#[cube]
fn keys_seen(first_query: usize, seq: usize, #[comptime] causal: bool) -> usize {
    let mut end = seq;
    if causal {
        end = min(first_query + TILE, seq);
    }
    end
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn flash_forward_kernel<F: Float>(
    query: &Tensor<F>,
    key: &Tensor<F>,
    value: &Tensor<F>,
    output: &mut Tensor<F>,
    logsumexp: &mut Tensor<f32>,
    seq: usize,
    scale: f32,
    d: usize,
    #[comptime] width: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let head = CUBE_POS_Y as usize;
    let row = unit_row(seq);
    let index = head * seq + row;
    let q = load_row::<F>(query, index * d, d, width);

    let mut acc = zero_row(d, width);
    let mut scores = Array::<f32>::new(TILE);
    let mut running_max = f32::new(MASKED);
    let mut sum = 0.0f32;

    let end = keys_seen(CUBE_POS_X as usize * TILE, seq, causal);
    for first_key in range_stepped(0, end, TILE) {
        let mut tile_max = f32::new(MASKED);
        for j in 0..TILE {
            let key_start = (head * seq + min(first_key + j, seq - 1)) * d;
            let score = dot_row::<F>(&q, key, key_start, d) * scale;
            let seen = visible(row, first_key + j, seq, causal);
            scores[j] = select(seen, score, f32::new(MASKED));
            tile_max = tile_max.max(scores[j]);
        }
        let new_max = running_max.max(tile_max);
        let correction = (running_max - new_max).exp();
        sum *= correction;
        scale_row(&mut acc, correction, d);
        for j in 0..TILE {
            let seen = visible(row, first_key + j, seq, causal);
            let p = select(seen, (scores[j] - new_max).exp(), 0.0f32);
            sum += p;
            let value_start = (head * seq + min(first_key + j, seq - 1)) * d;
            add_row::<F>(&mut acc, p, value, value_start, d);
        }
        running_max = new_max;
    }

    store_row::<F>(output, &acc, 1.0f32 / sum, index * d, d);
    logsumexp[index] = running_max + sum.ln();
}

/// `Δᵢ = dOᵢ·Oᵢ` for every row, in f32.
#[cube(launch_unchecked)]
fn row_dot_kernel<F: Float>(
    output: &Tensor<F>,
    output_grad: &Tensor<F>,
    delta: &mut Tensor<f32>,
    rows: usize,
    d: usize,
    #[comptime] width: usize,
    #[define(F)] _dtype: StorageType,
) {
    let row = min(ABSOLUTE_POS, rows - 1);
    let held = load_row::<F>(output, row * d, d, width);
    delta[row] = dot_row::<F>(&held, output_grad, row * d, d);
}

/// dK and dV: a cube owns `TILE` key rows of one head and walks the queries that see them.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn flash_backward_kv_kernel<F: Float>(
    query: &Tensor<F>,
    key: &Tensor<F>,
    value: &Tensor<F>,
    output_grad: &Tensor<F>,
    logsumexp: &Tensor<f32>,
    delta: &Tensor<f32>,
    key_grad: &mut Tensor<F>,
    value_grad: &mut Tensor<F>,
    seq: usize,
    scale: f32,
    d: usize,
    #[comptime] width: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let head = CUBE_POS_Y as usize;
    let key_row = unit_row(seq);
    let key_start = (head * seq + key_row) * d;
    let k = load_row::<F>(key, key_start, d, width);
    let v = load_row::<F>(value, key_start, d, width);

    let mut dk = zero_row(d, width);
    let mut dv = zero_row(d, width);
    // Under the mask the queries from the cube's first key on; every unit walks the same ones.
    let mut first_query = 0usize;
    if causal {
        first_query = CUBE_POS_X as usize * TILE;
    }
    for query_row in first_query..seq {
        let index = head * seq + query_row;
        let start = index * d;
        let (score, prob_grad) = dot_rows::<F>(&k, query, &v, output_grad, start, d);
        let seen = visible(query_row, key_row, seq, causal);
        let p = select(seen, (score * scale - logsumexp[index]).exp(), 0.0f32);
        let ds = p * (prob_grad - delta[index]) * scale;
        add_rows::<F>(&mut dv, p, output_grad, &mut dk, ds, query, start, d);
    }

    store_row::<F>(key_grad, &dk, 1.0, key_start, d);
    store_row::<F>(value_grad, &dv, 1.0, key_start, d);
}

/// dQ: a cube owns `TILE` query rows of one head and walks the keys they see.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn flash_backward_q_kernel<F: Float>(
    query: &Tensor<F>,
    key: &Tensor<F>,
    value: &Tensor<F>,
    output_grad: &Tensor<F>,
    logsumexp: &Tensor<f32>,
    delta: &Tensor<f32>,
    query_grad: &mut Tensor<F>,
    seq: usize,
    scale: f32,
    d: usize,
    #[comptime] width: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let head = CUBE_POS_Y as usize;
    let row = unit_row(seq);
    let index = head * seq + row;
    let q = load_row::<F>(query, index * d, d, width);
    let grad = load_row::<F>(output_grad, index * d, d, width);
    let (row_lse, row_delta) = (logsumexp[index], delta[index]);

    let mut dq = zero_row(d, width);
    let end = keys_seen(CUBE_POS_X as usize * TILE, seq, causal);
    for key_row in 0..end {
        let start = (head * seq + key_row) * d;
        let (score, prob_grad) = dot_rows::<F>(&q, key, &grad, value, start, d);
        let seen = visible(row, key_row, seq, causal);
        let p = select(seen, (score * scale - row_lse).exp(), 0.0f32);
        let ds = p * (prob_grad - row_delta) * scale;
        add_row::<F>(&mut dq, ds, key, start, d);
    }

    store_row::<F>(query_grad, &dq, 1.0, index * d, d);
}

/// Why the kernels cannot run attention on inputs of these shapes and types (query, key, value,
/// …) on `device` (the caller then runs the reference), or `None`.
pub fn unsupported<R: CubeRuntime>(inputs: &[TensorSpec], device: &R::Device) -> Option<String> {
    let query = inputs.first()?;
    let (shape, dtype) = (&query.shape, query.dtype);
    if shape.num_dims() != 4 {
        return Some(format!("inputs of rank {} (4 expected)", shape.num_dims()));
    }
    if let Some(other) = inputs[1..3.min(inputs.len())]
        .iter()
        .find(|other| other.shape != *shape || other.dtype != dtype)
    {
        return Some(format!(
            "key or value {:?} {:?} unlike the query {:?} {dtype:?}",
            other.shape, other.dtype, shape
        ));
    }
    if shape.num_elements() == 0 {
        return Some(format!("empty inputs {shape:?}"));
    }
    let d = shape[3];
    if d > MAX_HEAD_DIM {
        return Some(format!("head dim {d} is above {MAX_HEAD_DIM}"));
    }
    if let Err(reason) = unsupported_float::<R>(dtype, device) {
        return Some(reason);
    }
    let seq = shape[2];
    if loops_capped::<R>(device) && loop_iterations(seq, d) > LOOP_ITERATION_CAP {
        return Some(format!(
            "length {seq} at head dim {d} needs {} loop iterations per invocation, over the \
             {LOOP_ITERATION_CAP} lavapipe allows on wgpu",
            loop_iterations(seq, d)
        ));
    }
    None
}

/// The loop iterations one invocation runs in the heavier kernel, with `s = ⌈d/UNROLL⌉` steps
/// per walk over a row: the forward loads, zeroes and stores a row once each and per tile of
/// keys walks two rows per key, rescales its accumulator and steps; the backward kernels load,
/// zero and store up to two rows each and walk two rows per row of the other side.
fn loop_iterations(seq: usize, d: usize) -> usize {
    let steps = d.div_ceil(UNROLL);
    let forward = 3 * steps + seq.div_ceil(TILE) * (2 * TILE * (steps + 1) + steps + 1);
    let backward = 6 * steps + seq * (2 * steps + 1);
    forward.max(backward)
}

/// The launch geometry shared by the kernels: a cube per `TILE` rows of a head, a unit per row.
struct Launch {
    heads: usize,
    seq: usize,
    d: usize,
    scale: f32,
}

impl Launch {
    fn of<R: CubeRuntime>(query: &CubeTensor<R>) -> Self {
        let [batch, heads, seq, d] = query.meta.shape().dims::<4>();
        Self {
            heads: batch * heads,
            seq,
            d,
            scale: 1.0 / (d as f32).sqrt(),
        }
    }

    fn cubes(&self) -> CubeCount {
        CubeCount::Static(self.seq.div_ceil(TILE) as u32, self.heads as u32, 1)
    }

    fn cube_dim(&self) -> CubeDim {
        CubeDim::new_1d(TILE as u32)
    }
}

/// The forward: the output (in the inputs' type) and the logsumexp `[batch, heads, seq]` (f32).
/// The caller checks [`unsupported`] first.
pub fn forward<R: CubeRuntime>(
    query: CubeTensor<R>,
    key: CubeTensor<R>,
    value: CubeTensor<R>,
    causal: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let [query, key, value] = [query, key, value].map(into_contiguous);
    let launch = Launch::of(&query);
    let shape = query.meta.shape().clone();
    let output = empty_on(&query, shape.clone(), query.dtype);
    let [batch, heads, seq, _] = shape.dims::<4>();
    let logsumexp = empty_on(&query, Shape::new([batch, heads, seq]), DType::F32);
    let dtype = query.dtype;
    // SAFETY: every index is below `heads·seq·d` of contiguous tensors of the shapes the kernel
    // assumes (rows and key rows are clamped to `seq − 1`; columns are clamped to `d − 1` on
    // reads, where the padding of a row past `d` reads the last column, and skipped past `d` on
    // writes).
    unsafe {
        flash_forward_kernel::launch_unchecked(
            &query.client.clone(),
            launch.cubes(),
            launch.cube_dim(),
            query.into_tensor_arg(),
            key.into_tensor_arg(),
            value.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            logsumexp.clone().into_tensor_arg(),
            launch.seq,
            launch.scale,
            launch.d,
            row_width(launch.d),
            causal,
            dtype.into(),
        )
    };
    (output, logsumexp)
}

/// The backward: the gradients of query, key and value (in the inputs' type), from the saved
/// output and logsumexp (the output gradient may be of another float type). The caller checks
/// [`unsupported`] first.
pub fn backward<R: CubeRuntime>(inputs: [CubeTensor<R>; 6], causal: bool) -> [CubeTensor<R>; 3] {
    let [query, key, value, output, logsumexp, output_grad] = inputs.map(into_contiguous);
    let dtype = query.dtype;
    // `cast` returns a tensor already in `dtype` as it is.
    let output_grad = burn_cubecl::kernel::cast(output_grad, dtype);
    let launch = Launch::of(&query);
    let shape = query.meta.shape().clone();
    let [query_grad, key_grad, value_grad] =
        [(); 3].map(|_| empty_on(&query, shape.clone(), dtype));
    let delta = empty_on(&query, logsumexp.meta.shape().clone(), DType::F32);
    let rows = launch.heads * launch.seq;
    let client = query.client.clone();
    // SAFETY: as in `forward`; the kernels write disjoint outputs, and `delta` is written by the
    // first before the others read it (one stream, in order).
    unsafe {
        row_dot_kernel::launch_unchecked(
            &client,
            CubeCount::Static(rows.div_ceil(TILE) as u32, 1, 1),
            CubeDim::new_1d(TILE as u32),
            output.into_tensor_arg(),
            output_grad.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            rows,
            launch.d,
            row_width(launch.d),
            dtype.into(),
        );
        flash_backward_kv_kernel::launch_unchecked(
            &client,
            launch.cubes(),
            launch.cube_dim(),
            query.clone().into_tensor_arg(),
            key.clone().into_tensor_arg(),
            value.clone().into_tensor_arg(),
            output_grad.clone().into_tensor_arg(),
            logsumexp.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            key_grad.clone().into_tensor_arg(),
            value_grad.clone().into_tensor_arg(),
            launch.seq,
            launch.scale,
            launch.d,
            row_width(launch.d),
            causal,
            dtype.into(),
        );
        flash_backward_q_kernel::launch_unchecked(
            &client,
            launch.cubes(),
            launch.cube_dim(),
            query.into_tensor_arg(),
            key.into_tensor_arg(),
            value.into_tensor_arg(),
            output_grad.into_tensor_arg(),
            logsumexp.into_tensor_arg(),
            delta.into_tensor_arg(),
            query_grad.clone().into_tensor_arg(),
            launch.seq,
            launch.scale,
            launch.d,
            row_width(launch.d),
            causal,
            dtype.into(),
        );
    }
    [query_grad, key_grad, value_grad]
}
