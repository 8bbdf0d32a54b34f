//! The CubeCL kernels of LayerNorm and RMSNorm ([`super`]'s op), computed in f32:
//!
//! - **forward**: one cube per row, of [`row_units`] units. They stride over the row's columns; each pass ends in
//!   a tree sum over the cube's shared memory (`μ`, then `σ²` around `μ`: two passes as in
//!   [`super`], one for RMSNorm), and a last pass writes `y` in `x`'s type.
//! - **backward**: one cube per row recomputes `μ` and `r`, sums `⟨g⟩` and `⟨g ∘ x̂⟩` the same
//!   way and writes `dx` in `x`'s type, keeping each row's `μ` and `r` (`[2, rows]`, f32). Then
//!   `dγ` and `dβ`, sums over the rows: each unit sums one column over a block of
//!   [`BLOCK_ROWS`] rows, and a second launch sums each column's blocks in order.
//!
//! Every sum is taken in a fixed order, so a result does not depend on the run; it is not the
//! reference's order (Burn's reductions), so the two agree within a few ulps per term.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

use crate::kernels::cube_kernel::{CubeKernel, TensorSpec, unsupported_float};
use crate::kernels::launch::{accepted, elementwise_grid, empty_like, empty_on};
use crate::kernels::route::LOOP_ITERATION_CAP;

/// The most units of a row's cube, and the units of a cube of the column launches.
const MAX_UNITS: usize = 256;
/// The rows each unit of the `dγ`/`dβ` launch sums before the blocks are summed.
const BLOCK_ROWS: usize = 128;

/// The sum of the cube's `partial`s, in a fixed order: a tree over `shared` (one slot per
/// unit of a cube whose size is a power of two). Every unit receives it.
#[cube]
fn cube_sum(partial: f32, shared: &mut SharedMemory<f32>) -> f32 {
    let unit = UNIT_POS_X as usize;
    shared[unit] = partial;
    sync_cube();
    let mut stride = (CUBE_DIM_X / 2) as usize;
    while stride > 0 {
        if unit < stride {
            shared[unit] = shared[unit] + shared[unit + stride];
        }
        sync_cube();
        stride /= 2;
    }
    let total = shared[0];
    sync_cube();
    total
}

/// `μ` of the row of `x` starting at `start` (0 unless `centred`).
#[cube]
fn row_mean<F: Float>(
    x: &Tensor<F>,
    start: usize,
    columns: usize,
    shared: &mut SharedMemory<f32>,
    #[comptime] centred: bool,
) -> f32 {
    let mut mean = 0.0f32;
    if centred {
        let mut sum = 0.0f32;
        let mut column = UNIT_POS_X as usize;
        while column < columns {
            sum += f32::cast_from(x[start + column]);
            column += CUBE_DIM_X as usize;
        }
        mean = cube_sum(sum, shared) / f32::cast_from(columns);
    }
    mean
}

/// `r = 1/√(⟨(x − μ)²⟩ + ε)` of the row of `x` starting at `start`.
#[cube]
fn row_inverse_deviation<F: Float>(
    x: &Tensor<F>,
    start: usize,
    columns: usize,
    mean: f32,
    epsilon: f32,
    shared: &mut SharedMemory<f32>,
) -> f32 {
    let mut squares = 0.0f32;
    let mut column = UNIT_POS_X as usize;
    while column < columns {
        let centred = f32::cast_from(x[start + column]) - mean;
        squares += centred * centred;
        column += CUBE_DIM_X as usize;
    }
    let variance = cube_sum(squares, shared) / f32::cast_from(columns);
    1.0f32 / (variance + epsilon).sqrt()
}

/// The cube's row of `x: [rows, columns]` (cubes past the rows end here): where it starts,
/// its `μ` and its `r`.
#[cube]
fn row_statistics<F: Float>(
    x: &Tensor<F>,
    rows: usize,
    columns: usize,
    epsilon: f32,
    shared: &mut SharedMemory<f32>,
    #[comptime] centred: bool,
) -> (usize, f32, f32) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let start = row * columns;
    let mean = row_mean(x, start, columns, shared, centred);
    let r = row_inverse_deviation(x, start, columns, mean, epsilon, shared);
    (start, mean, r)
}

/// One cube per row of `x: [rows, columns]`: `out = F(x̂ ∘ γ + β)`.
#[cube(launch_unchecked)]
fn forward_rows<F: Float, G: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<G>,
    beta: &Tensor<G>,
    out: &mut Tensor<F>,
    rows: usize,
    columns: usize,
    epsilon: f32,
    #[comptime] centred: bool,
    #[comptime] units: usize,
    #[define(F, G)] _dtypes: [StorageType; 2],
) {
    let mut shared = SharedMemory::<f32>::new(units);
    let (start, mean, r) = row_statistics(x, rows, columns, epsilon, &mut shared, centred);
    let mut column = UNIT_POS_X as usize;
    while column < columns {
        let normalised = (f32::cast_from(x[start + column]) - mean) * r;
        let scaled = normalised * f32::cast_from(gamma[column]) + f32::cast_from(beta[column]);
        out[start + column] = F::cast_from(scaled);
        column += CUBE_DIM_X as usize;
    }
}

/// One cube per row: `dx = F(r·(g − ⟨g⟩ − x̂ ∘ ⟨g ∘ x̂⟩))` with `g = dy ∘ γ` (no `⟨g⟩` term
/// for RMSNorm), and the row's `μ` and `r` in `stats[row]` and `stats[rows + row]`.
#[cube(launch_unchecked)]
fn backward_rows<F: Float, G: Float>(
    x: &Tensor<F>,
    gamma: &Tensor<G>,
    output_grad: &Tensor<F>,
    x_grad: &mut Tensor<F>,
    stats: &mut Tensor<f32>,
    rows: usize,
    columns: usize,
    epsilon: f32,
    #[comptime] centred: bool,
    #[comptime] units: usize,
    #[define(F, G)] _dtypes: [StorageType; 2],
) {
    let mut shared = SharedMemory::<f32>::new(units);
    let (start, mean, r) = row_statistics(x, rows, columns, epsilon, &mut shared, centred);
    let mut g_sum = 0.0f32;
    let mut g_normalised_sum = 0.0f32;
    let mut column = UNIT_POS_X as usize;
    while column < columns {
        let g = f32::cast_from(output_grad[start + column]) * f32::cast_from(gamma[column]);
        g_sum += g;
        g_normalised_sum += g * (f32::cast_from(x[start + column]) - mean) * r;
        column += CUBE_DIM_X as usize;
    }
    let n = f32::cast_from(columns);
    let mut g_mean = 0.0f32;
    if centred {
        g_mean = cube_sum(g_sum, &mut shared) / n;
    }
    let g_normalised_mean = cube_sum(g_normalised_sum, &mut shared) / n;
    let mut column = UNIT_POS_X as usize;
    while column < columns {
        let normalised = (f32::cast_from(x[start + column]) - mean) * r;
        let g = f32::cast_from(output_grad[start + column]) * f32::cast_from(gamma[column]);
        x_grad[start + column] = F::cast_from(r * (g - g_mean - normalised * g_normalised_mean));
        column += CUBE_DIM_X as usize;
    }
    if UNIT_POS_X == 0 {
        let row = CUBE_POS;
        stats[row] = mean;
        stats[rows + row] = r;
    }
}

/// One unit per column and block of [`BLOCK_ROWS`] rows (cube `y`): the block's sums of
/// `dy ∘ x̂` and `dy`, in `partials[block, column]` and `partials[blocks + block, column]`.
#[cube(launch_unchecked)]
fn column_blocks<F: Float>(
    x: &Tensor<F>,
    output_grad: &Tensor<F>,
    stats: &Tensor<f32>,
    partials: &mut Tensor<f32>,
    rows: usize,
    columns: usize,
    blocks: usize,
    #[comptime] block_rows: usize,
    #[define(F)] _dtype: StorageType,
) {
    let column = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let block = CUBE_POS_Y as usize;
    if column < columns {
        let first = block * block_rows;
        let mut end = first + block_rows;
        if end > rows {
            end = rows;
        }
        let mut gamma_sum = 0.0f32;
        let mut beta_sum = 0.0f32;
        for row in first..end {
            let at = row * columns + column;
            let dy = f32::cast_from(output_grad[at]);
            let normalised = (f32::cast_from(x[at]) - stats[row]) * stats[rows + row];
            gamma_sum += dy * normalised;
            beta_sum += dy;
        }
        partials[block * columns + column] = gamma_sum;
        partials[(blocks + block) * columns + column] = beta_sum;
    }
}

/// One unit per column: the sums of its `blocks` partials, in block order, as `dγ` and `dβ`.
#[cube(launch_unchecked)]
fn column_sums(
    partials: &Tensor<f32>,
    gamma_grad: &mut Tensor<f32>,
    beta_grad: &mut Tensor<f32>,
    blocks: usize,
) {
    let column = ABSOLUTE_POS;
    let columns = gamma_grad.len();
    if column < columns {
        let mut gamma_sum = 0.0f32;
        let mut beta_sum = 0.0f32;
        for block in 0..blocks {
            gamma_sum += partials[block * columns + column];
            beta_sum += partials[(blocks + block) * columns + column];
        }
        gamma_grad[column] = gamma_sum;
        beta_grad[column] = beta_sum;
    }
}

/// `[rows, columns]` of `x: [.., columns]` with `parameters` `[columns]` on `device`, once the
/// kernels take them (non-empty, float types the device has, parameters of one type, rows
/// within one launch's reach); or why not.
fn rows_and_columns<R: CubeRuntime>(
    x: &TensorSpec,
    parameters: &[&TensorSpec],
    device: &R::Device,
) -> Result<[usize; 2], String> {
    let shape = &x.shape;
    let elements = shape.num_elements();
    if shape.num_dims() == 0 || elements == 0 {
        return Err(format!("input {shape:?} (a non-empty [.., columns])"));
    }
    let columns = shape[shape.num_dims() - 1];
    let rows = elements / columns;
    for tensor in std::iter::once(x).chain(parameters.iter().copied()) {
        unsupported_float::<R>(tensor.dtype, device)?;
    }
    for parameter in parameters {
        if parameter.shape != Shape::new([columns]) || parameter.dtype != parameters[0].dtype {
            return Err(format!(
                "parameter {:?} {:?} for input {shape:?} (one value per column, one type)",
                parameter.shape, parameter.dtype
            ));
        }
    }
    // Each unit's loops: up to four passes over its share of a row, a tree sum per pass.
    let units = row_units(columns);
    let row_iterations = 4 * columns.div_ceil(units) + 4 * units.ilog2() as usize;
    if row_iterations > LOOP_ITERATION_CAP {
        return Err(format!("rows of {columns} columns"));
    }
    let max_blocks = R::client(device).properties().hardware.max_cube_count.1 as usize;
    if rows.div_ceil(BLOCK_ROWS) > max_blocks {
        return Err(format!(
            "{rows} rows (at most {max_blocks} blocks of {BLOCK_ROWS})"
        ));
    }
    Ok([rows, columns])
}

/// Why the backward kernels do not take `[x, γ, dy]`, if they do not: as the forward, and `dy`
/// of `x`'s shape and type.
fn backward_unsupported<R: CubeRuntime>(
    [x, gamma, output_grad]: &[TensorSpec; 3],
    device: &R::Device,
) -> Result<[usize; 2], String> {
    let rows_and_columns = rows_and_columns::<R>(x, &[gamma], device)?;
    if output_grad != x {
        return Err(format!(
            "output gradient {:?} {:?} for input {:?} {:?}",
            output_grad.shape, output_grad.dtype, x.shape, x.dtype
        ));
    }
    Ok(rows_and_columns)
}

/// The units of a row's cube: a power of two (for the tree sum) near a quarter of the
/// columns, so that each unit takes about four, from 32 (a warp) to [`MAX_UNITS`].
fn row_units(columns: usize) -> usize {
    (columns / 4).next_power_of_two().clamp(32, MAX_UNITS)
}

/// One cube of [`row_units`] per row.
fn row_grid<R: CubeRuntime>(
    x: &CubeTensor<R>,
    rows: usize,
    columns: usize,
) -> (CubeCount, CubeDim) {
    let units = row_units(columns);
    let cube_dim = CubeDim::new_1d(units as u32);
    let cubes = calculate_cube_count_elemwise(&x.client, rows * units, cube_dim);
    (cubes, cube_dim)
}

/// The forward kernel on `x: [.., n]` with `γ, β: [n]` (see [`super`]): `y` in `x`'s type; or
/// why it does not take them.
pub fn forward_kernel<R: CubeRuntime>(
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    beta: CubeTensor<R>,
    epsilon: f64,
    centred: bool,
) -> Result<CubeTensor<R>, String> {
    let [x_spec, gamma_spec, beta_spec] = [&x, &gamma, &beta].map(TensorSpec::of);
    let [rows, columns] = rows_and_columns::<R>(&x_spec, &[&gamma_spec, &beta_spec], &x.device)?;
    let [x, gamma, beta] = [x, gamma, beta].map(into_contiguous);
    let out = empty_like(&x);
    let (cubes, cube_dim) = row_grid(&x, rows, columns);
    let dtypes = [x.dtype.into(), gamma.dtype.into()];
    // SAFETY: `x` and `out` are contiguous `[rows, columns]`, `γ` and `β` contiguous
    // `[columns]` (checked); each cube below `rows` touches its own row, and the cubes past it
    // stop before any access.
    unsafe {
        forward_rows::launch_unchecked(
            &x.client.clone(),
            cubes,
            cube_dim,
            x.into_tensor_arg(),
            gamma.into_tensor_arg(),
            beta.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            rows,
            columns,
            epsilon as f32,
            centred,
            row_units(columns),
            dtypes,
        )
    };
    Ok(out)
}

/// The backward kernels on `x: [.., n]`, `γ: [n]` and `dy` (`x`'s shape and type): `[dx, dγ,
/// dβ]`, `dx` in `x`'s type and the others in f32; or why they do not take them.
pub fn backward_kernel<R: CubeRuntime>(
    x: CubeTensor<R>,
    gamma: CubeTensor<R>,
    output_grad: CubeTensor<R>,
    epsilon: f64,
    centred: bool,
) -> Result<[CubeTensor<R>; 3], String> {
    let specs = [&x, &gamma, &output_grad].map(TensorSpec::of);
    let [rows, columns] = backward_unsupported::<R>(&specs, &x.device)?;
    let [x, gamma, output_grad] = [x, gamma, output_grad].map(into_contiguous);
    let client = x.client.clone();
    let x_grad = empty_like(&x);
    let stats = empty_on(&x, Shape::new([2, rows]), DType::F32);
    let (cubes, cube_dim) = row_grid(&x, rows, columns);
    // SAFETY: as in the forward; `stats` is `[2, rows]`, written at `row` and `rows + row`.
    unsafe {
        backward_rows::launch_unchecked(
            &client,
            cubes,
            cube_dim,
            x.clone().into_tensor_arg(),
            gamma.clone().into_tensor_arg(),
            output_grad.clone().into_tensor_arg(),
            x_grad.clone().into_tensor_arg(),
            stats.clone().into_tensor_arg(),
            rows,
            columns,
            epsilon as f32,
            centred,
            row_units(columns),
            [x.dtype.into(), gamma.dtype.into()],
        )
    };
    let blocks = rows.div_ceil(BLOCK_ROWS);
    let partials = empty_on(&x, Shape::new([2 * blocks, columns]), DType::F32);
    let column_cubes = columns.div_ceil(MAX_UNITS) as u32;
    // SAFETY: each unit with `column < columns` reads rows `< rows` of `x`, `dy` and `stats`
    // and writes its own column of block `CUBE_POS_Y < blocks` in `[2·blocks, columns]`.
    unsafe {
        column_blocks::launch_unchecked(
            &client,
            CubeCount::new_2d(column_cubes, blocks as u32),
            CubeDim::new_1d(MAX_UNITS as u32),
            x.clone().into_tensor_arg(),
            output_grad.into_tensor_arg(),
            stats.into_tensor_arg(),
            partials.clone().into_tensor_arg(),
            rows,
            columns,
            blocks,
            BLOCK_ROWS,
            x.dtype.into(),
        )
    };
    let gamma_grad = empty_on(&x, Shape::new([columns]), DType::F32);
    let beta_grad = empty_like(&gamma_grad);
    let (cubes, cube_dim) = elementwise_grid(&gamma_grad);
    // SAFETY: each unit below `columns` reads its column of `[2·blocks, columns]`.
    unsafe {
        column_sums::launch_unchecked(
            &client,
            cubes,
            cube_dim,
            partials.into_tensor_arg(),
            gamma_grad.clone().into_tensor_arg(),
            beta_grad.clone().into_tensor_arg(),
            blocks,
        )
    };
    Ok([x_grad, gamma_grad, beta_grad])
}

/// [`forward_kernel`] for the router.
#[derive(Clone, Debug)]
pub(super) struct Forward {
    pub epsilon: f64,
    pub centred: bool,
}

impl CubeKernel<3, 1> for Forward {
    fn op(&self) -> &'static str {
        // LayerNorm centres, RMSNorm does not.
        match self.centred {
            true => "layer_norm forward",
            false => "rms_norm forward",
        }
    }

    fn outputs<R: CubeRuntime>(
        &self,
        [x, gamma, beta]: &[TensorSpec; 3],
        device: &R::Device,
    ) -> Result<[TensorSpec; 1], String> {
        rows_and_columns::<R>(x, &[gamma, beta], device)?;
        Ok([x.clone()])
    }

    fn launch<R: CubeRuntime>(&self, [x, gamma, beta]: [CubeTensor<R>; 3]) -> [CubeTensor<R>; 1] {
        let y = forward_kernel(x, gamma, beta, self.epsilon, self.centred);
        [accepted(self.op(), y)]
    }
}

/// [`backward_kernel`] for the router.
#[derive(Clone, Debug)]
pub(super) struct Backward {
    pub epsilon: f64,
    pub centred: bool,
}

impl CubeKernel<3, 3> for Backward {
    fn op(&self) -> &'static str {
        match self.centred {
            true => "layer_norm backward",
            false => "rms_norm backward",
        }
    }

    fn outputs<R: CubeRuntime>(
        &self,
        inputs: &[TensorSpec; 3],
        device: &R::Device,
    ) -> Result<[TensorSpec; 3], String> {
        let [_, columns] = backward_unsupported::<R>(inputs, device)?;
        let parameter_grad = TensorSpec::new(Shape::new([columns]), DType::F32);
        Ok([inputs[0].clone(), parameter_grad.clone(), parameter_grad])
    }

    fn launch<R: CubeRuntime>(
        &self,
        [x, gamma, output_grad]: [CubeTensor<R>; 3],
    ) -> [CubeTensor<R>; 3] {
        let grads = backward_kernel(x, gamma, output_grad, self.epsilon, self.centred);
        accepted(self.op(), grads)
    }
}
