//! FlashAttention-2 as CubeCL kernels, generic over the runtime (CUDA, wgpu), for f32, f16 and
//! bf16 inputs computed in f32. The math is the reference's ([`super::attention`]); these are
//! its tiles written as kernels.
//!
//! Tensors are `[batch, heads, seq, d]`, made contiguous first. A cube of `TILE` units owns
//! `TILE` rows of one head, one row per unit, held in registers (`d` up to [`MAX_HEAD_DIM`]):
//!
//! - **forward** — a unit walks the keys in tiles of `TILE`. It keeps its row's running max `m`,
//!   running sum `l` and unnormalised output `acc`; a tile with scores `s` updates
//!   `m' = max(m, max s)`, `l' = l·e^(m−m') + Σ e^(s−m')`, `acc' = acc·e^(m−m') + Σ e^(s−m') v`.
//!   It writes `O = acc/l` and `L = m + ln l`. No `T×T` matrix exists anywhere.
//! - **backward** — with `Δᵢ = dOᵢ·Oᵢ` (one small kernel) and `Pᵢⱼ = e^(sᵢⱼ − Lᵢ)` recomputed
//!   from the saved `L`: `dVⱼ = Σᵢ Pᵢⱼ dOᵢ`, `dSᵢⱼ = Pᵢⱼ (dOᵢ·Vⱼ − Δᵢ)`, `dKⱼ = c Σᵢ dSᵢⱼ Qᵢ`,
//!   `dQᵢ = c Σⱼ dSᵢⱼ Kⱼ` (`c = 1/√d`). One kernel owns key rows (dK, dV, walking the queries),
//!   one owns query rows (dQ, walking the keys); neither needs atomics.
//!
//! The units of a cube read the same key (or query) row at the same time, from cache; the rows
//! are not staged in shared memory. Lavapipe compiles every compute shader as LLVM coroutines
//! and took over a minute per kernel with barriers and compile-time loop bounds, so `d` and the
//! tile are runtime values here and there are no barriers. Staging tiles in shared memory and
//! tensor-core (`cmma`) inner products are what GPU throughput needs next
//! (docs/benchmarks/kernels.md).
//!
//! Under the causal mask a cube walks only the keys (or queries) its rows can see. Control flow
//! is the same for every unit of a cube: masked scores are selected away rather than skipped,
//! and units past the sequence end (a length that is not a multiple of the tile) compute the
//! last row again and write the same bits to it. Lavapipe (Mesa 22.3) miscompiled loops that
//! some units of a SIMD group skipped (they ran one iteration, for every unit), which these
//! kernels never have.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// A score below every real one: `e^(MASKED − m)` is 0 for any finite `m`.
const MASKED: f32 = -1.0e30;

/// Rows per cube, and keys per online-softmax step.
const TILE: usize = 32;

/// The largest head dim the kernels take (a row lives in registers).
pub const MAX_HEAD_DIM: usize = 256;

/// `Σₖ a[k]·src[start + k]`, in f32.
#[cube]
fn dot<F: Float>(a: &Array<f32>, src: &Tensor<F>, start: usize, d: usize) -> f32 {
    let mut sum = 0.0f32;
    for k in 0..d {
        sum += a[k] * f32::cast_from(src[start + k]);
    }
    sum
}

/// Row `row` of `src` (head `head`) in registers, times `factor`, as f32 (zeros past the end).
#[cube]
fn row_registers<F: Float>(
    src: &Tensor<F>,
    head: usize,
    row: usize,
    seq: usize,
    factor: f32,
    d: usize,
    #[comptime] capacity: usize,
) -> Array<f32> {
    let mut out = Array::<f32>::new(capacity);
    let start = (head * seq + row) * d;
    for k in 0..d {
        let mut value = 0.0f32;
        if row < seq {
            value = f32::cast_from(src[start + k]) * factor;
        }
        out[k] = value;
    }
    out
}

#[cube]
fn zeros(d: usize, #[comptime] capacity: usize) -> Array<f32> {
    let mut out = Array::<f32>::new(capacity);
    for k in 0..d {
        out[k] = 0.0;
    }
    out
}

/// Whether query `query` sees key `key`.
#[cube]
fn visible(query: usize, key: usize, seq: usize, #[comptime] causal: bool) -> bool {
    let mut seen = key < seq && query < seq;
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
    #[comptime] capacity: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let head = CUBE_POS_Y as usize;
    let first_query = CUBE_POS_X as usize * tile;
    let unit_row = first_query + UNIT_POS_X as usize;
    let row = min(unit_row, seq - 1);

    let q = row_registers::<F>(query, head, row, seq, scale, d, capacity);
    let mut acc = zeros(d, capacity);
    let mut scores = Array::<f32>::new(TILE);
    let mut running_max = f32::new(MASKED);
    let mut sum = 0.0f32;

    let end = keys_seen(first_query, seq, tile, causal);
    for first_key in range_stepped(0, end, tile) {
        let mut tile_max = f32::new(MASKED);
        for j in 0..tile {
            let key_row = min(first_key + j, seq - 1);
            let score = dot::<F>(&q, key, (head * seq + key_row) * d, d);
            let seen = visible(row, first_key + j, seq, causal);
            scores[j] = select(seen, score, f32::new(MASKED));
            tile_max = tile_max.max(scores[j]);
        }
        let new_max = running_max.max(tile_max);
        let correction = (running_max - new_max).exp();
        sum *= correction;
        for k in 0..d {
            acc[k] *= correction;
        }
        for j in 0..tile {
            let seen = visible(row, first_key + j, seq, causal);
            let p = select(seen, (scores[j] - new_max).exp(), 0.0f32);
            sum += p;
            let start = (head * seq + min(first_key + j, seq - 1)) * d;
            for k in 0..d {
                acc[k] += p * f32::cast_from(value[start + k]);
            }
        }
        running_max = new_max;
    }

    let start = (head * seq + row) * d;
    let inverse = 1.0f32 / sum;
    for k in 0..d {
        output[start + k] = F::cast_from(acc[k] * inverse);
    }
    logsumexp[head * seq + row] = running_max + sum.ln();
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
    let mut sum = 0.0f32;
    for k in 0..d {
        sum += f32::cast_from(output[row * d + k]) * f32::cast_from(output_grad[row * d + k]);
    }
    delta[row] = sum;
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
    #[comptime] capacity: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let head = CUBE_POS_Y as usize;
    let unit_row = CUBE_POS_X as usize * tile + UNIT_POS_X as usize;
    let key_row = min(unit_row, seq - 1);

    // `k` holds c·K, so `k·Qᵢ` is the scaled score.
    let k = row_registers::<F>(key, head, key_row, seq, scale, d, capacity);
    let v = row_registers::<F>(value, head, key_row, seq, 1.0, d, capacity);
    let mut dk = zeros(d, capacity);
    let mut dv = zeros(d, capacity);
    // Under the mask the queries from the cube's first key on; every unit walks the same ones.
    let mut first_query = 0usize;
    if causal {
        first_query = CUBE_POS_X as usize * tile;
    }
    for query_row in first_query..seq {
        let index = head * seq + query_row;
        let start = index * d;
        let seen = visible(query_row, key_row, seq, causal);
        let p = select(
            seen,
            (dot::<F>(&k, query, start, d) - logsumexp[index]).exp(),
            0.0f32,
        );
        let ds = p * (dot::<F>(&v, output_grad, start, d) - delta[index]) * scale;
        for c in 0..d {
            dv[c] += p * f32::cast_from(output_grad[start + c]);
            dk[c] += ds * f32::cast_from(query[start + c]);
        }
    }

    let start = (head * seq + key_row) * d;
    for c in 0..d {
        key_grad[start + c] = F::cast_from(dk[c]);
        value_grad[start + c] = F::cast_from(dv[c]);
    }
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
    #[comptime] capacity: usize,
    #[comptime] causal: bool,
    #[define(F)] _dtype: StorageType,
) {
    let head = CUBE_POS_Y as usize;
    let unit_row = CUBE_POS_X as usize * tile + UNIT_POS_X as usize;
    let row = min(unit_row, seq - 1);

    let index = head * seq + row;
    let q = row_registers::<F>(query, head, row, seq, scale, d, capacity);
    let grad = row_registers::<F>(output_grad, head, row, seq, 1.0, d, capacity);
    let (row_lse, row_delta) = (logsumexp[index], delta[index]);
    let mut dq = zeros(d, capacity);
    let end = keys_seen(CUBE_POS_X as usize * tile, seq, tile, causal);
    for key_row in 0..end {
        let start = (head * seq + key_row) * d;
        let seen = visible(row, key_row, seq, causal);
        let p = select(seen, (dot::<F>(&q, key, start, d) - row_lse).exp(), 0.0f32);
        let ds = p * (dot::<F>(&grad, value, start, d) - row_delta) * scale;
        for c in 0..d {
            dq[c] += ds * f32::cast_from(key[start + c]);
        }
    }

    for c in 0..d {
        query_grad[index * d + c] = F::cast_from(dq[c]);
    }
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
    None
}

/// The launch geometry shared by the kernels: a cube of `TILE` units per `TILE` rows of a head.
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

    /// The register capacity of a row: `d` rounded up to a power of two (at least 32), so the
    /// kernels compile once per bucket rather than once per head dim. `d` itself is a runtime
    /// value: a compile-time one let lavapipe's LLVM unroll every row loop, and compiling one
    /// forward took a minute.
    fn capacity(&self) -> usize {
        self.d.next_power_of_two().max(32)
    }

    fn cubes(&self) -> CubeCount {
        CubeCount::Static(self.seq.div_ceil(TILE) as u32, self.heads as u32, 1)
    }

    fn cube_dim(&self) -> CubeDim {
        CubeDim::new_1d(TILE as u32)
    }
}

/// A new tensor on `tensor`'s device with contiguous strides, which the kernels index by (the
/// allocator's default layout may pad rows).
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
    // SAFETY: units past the sequence end return before touching memory, and every other index
    // is below `heads·seq·d` of contiguous tensors of the shapes the kernel assumes.
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
            launch.capacity(),
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
    let output_grad = match output_grad.dtype == dtype {
        true => output_grad,
        false => burn_cubecl::kernel::cast(output_grad, dtype),
    };
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
            launch.cube_dim(),
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
            launch.capacity(),
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
            launch.capacity(),
            causal,
            dtype.into(),
        );
    }
    [query_grad, key_grad, value_grad]
}
