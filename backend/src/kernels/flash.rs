//! FlashAttention-2 as CubeCL kernels, generic over the runtime (CUDA, wgpu), for f32, f16 and
//! bf16 inputs computed in f32. The math is the reference's ([`super::attention`]); these are
//! its tiles written as kernels.
//!
//! Tensors are `[batch, heads, seq, d]`, made contiguous first. A cube owns `TILE` (32) rows of
//! one head; a unit owns one row and `CHUNK` (32) of its columns, so a cube has 32 × ⌈d/32⌉
//! units (`d` up to [`MAX_HEAD_DIM`]). Scores are full dot products over `d`, which every
//! column unit of a row computes alike (the same bits):
//!
//! - **forward** — a unit walks the keys in tiles of `TILE`. It keeps its row's running max `m`,
//!   running sum `l` and its columns of the unnormalised output `acc`; a tile with scores `s`
//!   updates `m' = max(m, max s)`, `l' = l·e^(m−m') + Σ e^(s−m')`,
//!   `acc' = acc·e^(m−m') + Σ e^(s−m') v`. It writes `O = acc/l` and `L = m + ln l`. No `T×T`
//!   matrix exists anywhere.
//! - **backward** — with `Δᵢ = dOᵢ·Oᵢ` (one small kernel) and `Pᵢⱼ = e^(sᵢⱼ − Lᵢ)` recomputed
//!   from the saved `L`: `dVⱼ = Σᵢ Pᵢⱼ dOᵢ`, `dSᵢⱼ = Pᵢⱼ (dOᵢ·Vⱼ − Δᵢ)`, `dKⱼ = c Σᵢ dSᵢⱼ Qᵢ`,
//!   `dQᵢ = c Σⱼ dSᵢⱼ Kⱼ` (`c = 1/√d`). One kernel owns key rows (dK, dV, walking the queries),
//!   one owns query rows (dQ, walking the keys); neither needs atomics.
//!
//! Rows are read from global memory (cache), not staged in shared memory. Lavapipe compiles
//! every compute shader as LLVM coroutines and took over a minute per kernel with barriers and
//! compile-time loop bounds, so `d` and the tile are runtime values and there are no barriers.
//! Staging tiles in shared memory and tensor-core (`cmma`) inner products are what GPU
//! throughput needs next.
//!
//! **Lavapipe's loop cap.** Lavapipe stops an invocation's loops once they have run 65535
//! iterations together ([`super::route::LOOP_ITERATION_CAP`]), silently. With a plain loop per
//! dot product the backward passed that at head dim 128 and length 256 (2·128 iterations per
//! query row), and gave wrong gradients. The dot products are unrolled by 32 now
//! (`super::dot`), an invocation runs about `seq·(1 + 2·d/32)` iterations, and on wgpu the
//! kernels decline the shapes still past the cap (length ≳ 7000 at head dim 128).
//!
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::dot::{dot, dot_iterations};
use super::route::{LOOP_ITERATION_CAP, loops_capped};

/// A score below every real one: `e^(MASKED − m)` is 0 for any finite `m`.
const MASKED: f32 = -1.0e30;

/// Rows per cube, and keys per online-softmax step.
const TILE: usize = 32;

/// Columns of a row one unit accumulates (see the module doc).
const CHUNK: usize = 32;

/// The largest head dim the kernels take: `CHUNK` columns per unit, at most 256 units a cube.
pub const MAX_HEAD_DIM: usize = 256;

/// `Σₖ a[sa + k]·b[sb + k]` over `d` elements, in f32.
#[cube]
fn row_dot<F: Float>(a: &Tensor<F>, sa: usize, b: &Tensor<F>, sb: usize, d: usize) -> f32 {
    dot::<F>(a, sa, 1, b, sb, 1, d)
}

/// `CHUNK` zeros: one unit's share of a row.
#[cube]
fn zeros() -> Array<f32> {
    let mut out = Array::<f32>::new(CHUNK);
    #[unroll]
    for c in 0..CHUNK {
        out[c] = 0.0;
    }
    out
}

/// `acc[c] += factor · src[start + min(first + c, d − 1)]` for this unit's `CHUNK` columns
/// starting at `first` (columns past `d` read the last one and are never written).
#[cube]
fn add_scaled<F: Float>(
    acc: &mut Array<f32>,
    factor: f32,
    src: &Tensor<F>,
    start: usize,
    first: usize,
    d: usize,
) {
    #[unroll]
    for c in 0..CHUNK {
        let column = min(first + c, d - 1);
        acc[c] += factor * f32::cast_from(src[start + column]);
    }
}

/// `dst[start + first + c] = acc[c]·factor` for the columns below `d`.
#[cube]
fn store<F: Float>(
    dst: &mut Tensor<F>,
    acc: &Array<f32>,
    factor: f32,
    start: usize,
    first: usize,
    d: usize,
) {
    #[unroll]
    for c in 0..CHUNK {
        if first + c < d {
            dst[start + first + c] = F::cast_from(acc[c] * factor);
        }
    }
}

/// The row this unit owns: row `UNIT_POS_Y` of the cube's `tile`, or the last row for units
/// past the sequence end (they compute it again and write the same bits).
#[cube]
fn unit_row(tile: usize, seq: usize) -> usize {
    min(CUBE_POS_X as usize * tile + UNIT_POS_Y as usize, seq - 1)
}

/// The first of the `CHUNK` columns this unit owns.
#[cube]
fn unit_first_column() -> usize {
    UNIT_POS_X as usize * CHUNK
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
fn keys_seen(first_query: usize, seq: usize, tile: usize, #[comptime] causal: bool) -> usize {
    let mut end = seq;
    if causal {
        end = min(first_query + tile, seq);
    }
    end
}

#[cube(launch_unchecked)]
fn flash_forward_kernel<F: Float>(
    query: &Tensor<F>,
    key: &Tensor<F>,
    value: &Tensor<F>,
    output: &mut Tensor<F>,
    logsumexp: &mut Tensor<f32>,
    seq: usize,
    scale: f32,
    d: usize,
    tile: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let head = CUBE_POS_Y as usize;
    let first_query = CUBE_POS_X as usize * tile;
    let row = unit_row(tile, seq);
    let first_column = unit_first_column();
    let query_start = (head * seq + row) * d;

    let mut acc = zeros();
    let mut scores = Array::<f32>::new(TILE);
    let mut running_max = f32::new(MASKED);
    let mut sum = 0.0f32;

    let end = keys_seen(first_query, seq, tile, causal);
    for first_key in range_stepped(0, end, tile) {
        let mut tile_max = f32::new(MASKED);
        for j in 0..tile {
            let key_start = (head * seq + min(first_key + j, seq - 1)) * d;
            let score = row_dot::<F>(query, query_start, key, key_start, d) * scale;
            let seen = visible(row, first_key + j, seq, causal);
            scores[j] = select(seen, score, f32::new(MASKED));
            tile_max = tile_max.max(scores[j]);
        }
        let new_max = running_max.max(tile_max);
        let correction = (running_max - new_max).exp();
        sum *= correction;
        #[unroll]
        for c in 0..CHUNK {
            acc[c] *= correction;
        }
        for j in 0..tile {
            let seen = visible(row, first_key + j, seq, causal);
            let p = select(seen, (scores[j] - new_max).exp(), 0.0f32);
            sum += p;
            let value_start = (head * seq + min(first_key + j, seq - 1)) * d;
            add_scaled::<F>(&mut acc, p, value, value_start, first_column, d);
        }
        running_max = new_max;
    }

    store::<F>(output, &acc, 1.0f32 / sum, query_start, first_column, d);
    if UNIT_POS_X == 0 {
        logsumexp[head * seq + row] = running_max + sum.ln();
    }
}

/// `Δᵢ = dOᵢ·Oᵢ` for every row, in f32.
#[cube(launch_unchecked)]
fn row_dot_kernel<F: Float>(
    output: &Tensor<F>,
    output_grad: &Tensor<F>,
    delta: &mut Tensor<f32>,
    rows: usize,
    d: usize,
    #[define(F)] _dtype: StorageType,
) {
    let row = min(ABSOLUTE_POS, rows - 1);
    delta[row] = row_dot::<F>(output, row * d, output_grad, row * d, d);
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
    tile: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let head = CUBE_POS_Y as usize;
    let key_row = unit_row(tile, seq);
    let first_column = unit_first_column();
    let key_start = (head * seq + key_row) * d;

    let mut dk = zeros();
    let mut dv = zeros();
    // Under the mask the queries from the cube's first key on; every unit walks the same ones.
    let mut first_query = 0usize;
    if causal {
        first_query = CUBE_POS_X as usize * tile;
    }
    for query_row in first_query..seq {
        let index = head * seq + query_row;
        let start = index * d;
        let seen = visible(query_row, key_row, seq, causal);
        let score = row_dot::<F>(key, key_start, query, start, d) * scale;
        let p = select(seen, (score - logsumexp[index]).exp(), 0.0f32);
        let ds = p * (row_dot::<F>(value, key_start, output_grad, start, d) - delta[index]) * scale;
        add_scaled::<F>(&mut dv, p, output_grad, start, first_column, d);
        add_scaled::<F>(&mut dk, ds, query, start, first_column, d);
    }

    store::<F>(key_grad, &dk, 1.0, key_start, first_column, d);
    store::<F>(value_grad, &dv, 1.0, key_start, first_column, d);
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
    tile: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let head = CUBE_POS_Y as usize;
    let row = unit_row(tile, seq);
    let first_column = unit_first_column();
    let index = head * seq + row;
    let query_start = index * d;
    let (row_lse, row_delta) = (logsumexp[index], delta[index]);

    let mut dq = zeros();
    let end = keys_seen(CUBE_POS_X as usize * tile, seq, tile, causal);
    for key_row in 0..end {
        let start = (head * seq + key_row) * d;
        let seen = visible(row, key_row, seq, causal);
        let score = row_dot::<F>(query, query_start, key, start, d) * scale;
        let p = select(seen, (score - row_lse).exp(), 0.0f32);
        let ds = p * (row_dot::<F>(output_grad, query_start, value, start, d) - row_delta) * scale;
        add_scaled::<F>(&mut dq, ds, key, start, first_column, d);
    }

    store::<F>(query_grad, &dq, 1.0, query_start, first_column, d);
}

/// Why the kernels cannot run attention on `inputs` (query, key, value, …; the caller then runs
/// the reference), or `None`.
pub fn unsupported<R: CubeRuntime>(inputs: &[CubeTensor<R>]) -> Option<String> {
    let query = inputs.first()?;
    let shape = query.meta.shape();
    let dtype = query.dtype;
    if shape.num_dims() != 4 {
        return Some(format!("inputs of rank {} (4 expected)", shape.num_dims()));
    }
    if let Some(other) = inputs[1..3.min(inputs.len())]
        .iter()
        .find(|other| other.meta.shape() != shape || other.dtype != dtype)
    {
        return Some(format!(
            "key or value {:?} {:?} unlike the query {:?} {dtype:?}",
            other.meta.shape(),
            other.dtype,
            shape
        ));
    }
    if shape.num_elements() == 0 {
        return Some(format!("empty inputs {shape:?}"));
    }
    let d = shape[3];
    if d > MAX_HEAD_DIM {
        return Some(format!("head dim {d} is above {MAX_HEAD_DIM}"));
    }
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Some(format!("dtype {dtype:?} (f32, f16 and bf16 are supported)"));
    }
    if !query.client.properties().supports_type(dtype) {
        return Some(format!("the device has no {dtype:?} arithmetic"));
    }
    let seq = shape[2];
    if loops_capped::<R>() && loop_iterations(seq, d) > LOOP_ITERATION_CAP {
        return Some(format!(
            "length {seq} at head dim {d} needs {} loop iterations per invocation, over the \
             {LOOP_ITERATION_CAP} lavapipe allows on wgpu",
            loop_iterations(seq, d)
        ));
    }
    None
}

/// The loop iterations one invocation of the heaviest kernel runs (the backward's: per key or
/// query row, one step and two dot products; the `CHUNK` loops are unrolled).
fn loop_iterations(seq: usize, d: usize) -> usize {
    seq * (1 + 2 * dot_iterations(d)) + seq.div_ceil(TILE)
}

/// The launch geometry shared by the kernels: a cube per `TILE` rows of a head, a unit per row
/// and `CHUNK` columns.
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
        CubeDim::new_2d(self.d.div_ceil(CHUNK) as u32, TILE as u32)
    }
}

fn empty_like<R: CubeRuntime>(tensor: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype(tensor.client.clone(), tensor.device.clone(), shape, dtype)
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
    let output = empty_like(&query, shape.clone(), query.dtype);
    let [batch, heads, seq, _] = shape.dims::<4>();
    let logsumexp = empty_like(&query, Shape::new([batch, heads, seq]), DType::F32);
    let dtype = query.dtype;
    // SAFETY: every index is below `heads·seq·d` of contiguous tensors of the shapes the kernel
    // assumes (rows and key rows are clamped to `seq − 1`, columns to `d − 1` on reads and
    // skipped past `d` on writes).
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
            TILE,
            causal,
            dtype.into(),
        )
    };
    (output, logsumexp)
}

/// The backward: the gradients of query, key and value (in the inputs' type), from the saved
/// output and logsumexp.
pub fn backward<R: CubeRuntime>(inputs: [CubeTensor<R>; 6], causal: bool) -> [CubeTensor<R>; 3] {
    let [query, key, value, output, logsumexp, output_grad] = inputs.map(into_contiguous);
    let dtype = query.dtype;
    // `cast` returns a tensor already in `dtype` as it is.
    let output_grad = burn_cubecl::kernel::cast(output_grad, dtype);
    let launch = Launch::of(&query);
    let shape = query.meta.shape().clone();
    let [query_grad, key_grad, value_grad] =
        [(); 3].map(|_| empty_like(&query, shape.clone(), dtype));
    let delta = empty_like(&query, logsumexp.meta.shape().clone(), DType::F32);
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
            TILE,
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
            TILE,
            causal,
            dtype.into(),
        );
    }
    [query_grad, key_grad, value_grad]
}
