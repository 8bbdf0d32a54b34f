//! Mixed-precision matmul: inputs rounded to f16 or bf16, products accumulated in f32, an
//! optional epilogue (bias add, then GELU), output in any float type; batched.
//!
//! For `lhs [.., m, k]` and `rhs [.., k, n]` the result is
//! `out[.., i, j] = g(Σₗ r(lhs[.., i, l])·r(rhs[.., l, j]) + bias[j])`, with `r` the rounding to
//! the compute type and `g` GPT-2's GELU or the identity. A product of two f16 (11-bit
//! significands) or two bf16 (8-bit) values is exact in f32 (24-bit), so the only rounding after
//! `r` is the f32 summation's, and the one to the output type.
//!
//! Two implementations with one meaning:
//! - **the kernel** (`mixed_matmul_kernel`, CubeCL, any runtime): a unit per 4×4 outputs, in
//!   registers. It stages nothing in shared memory and uses no tensor cores; it is correct, not
//!   yet fast (see docs/benchmarks/kernels.md);
//! - **the reference** in Burn ops (Flex, or whatever the kernel declines): round to the compute
//!   type, compute in f32 with the backend's own matmul, apply the epilogue in f32.
//!
//! [`MatmulPrecision`] is the policy that sends every float matmul of `Parallel<B>` — forward
//! and backward alike under `Autodiff<Parallel<B>>` — through this op (`decorator/overrides.rs`),
//! like PyTorch's `torch.set_float32_matmul_precision`: it is process-wide.

use std::sync::atomic::{AtomicU8, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Tensor, TensorMetadata, TensorPrimitive};

use super::route::on_cube;
pub use cube::kernel;

/// Which type the float matmuls of `Parallel<B>` compute in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MatmulPrecision {
    /// The backend's own matmul, in the inputs' type.
    #[default]
    Off,
    /// Inputs rounded to bf16, accumulated in f32, returned in the inputs' type.
    Bf16,
    /// Inputs rounded to f16, accumulated in f32, returned in the inputs' type.
    F16,
}

impl MatmulPrecision {
    /// The type inputs are rounded to, or `None` when the policy is off.
    pub fn compute_dtype(self) -> Option<FloatDType> {
        match self {
            Self::Off => None,
            Self::Bf16 => Some(FloatDType::BF16),
            Self::F16 => Some(FloatDType::F16),
        }
    }
}

impl std::str::FromStr for MatmulPrecision {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "off" => Ok(Self::Off),
            "bf16" => Ok(Self::Bf16),
            "f16" | "fp16" => Ok(Self::F16),
            _ => Err(format!(
                "unknown matmul precision {text:?} (expected off, bf16 or f16)"
            )),
        }
    }
}

impl std::fmt::Display for MatmulPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        })
    }
}

static POLICY: AtomicU8 = AtomicU8::new(0);

/// Sets the process-wide matmul precision policy (every rank of a job sets the same).
pub fn set_matmul_precision(precision: MatmulPrecision) {
    POLICY.store(precision as u8, Ordering::Relaxed);
}

/// The process-wide matmul precision policy (off until set).
pub fn matmul_precision() -> MatmulPrecision {
    match POLICY.load(Ordering::Relaxed) {
        1 => MatmulPrecision::Bf16,
        2 => MatmulPrecision::F16,
        _ => MatmulPrecision::Off,
    }
}

/// What a mixed-precision matmul computes in and returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MixedMatmul {
    /// The type the inputs are rounded to (f16 or bf16; f32 leaves them as they are).
    pub compute: FloatDType,
    /// The output's type.
    pub output: FloatDType,
    /// Whether GPT-2's GELU follows the bias add.
    pub gelu: bool,
}

/// `g(r(lhs)·r(rhs) + bias)` on `Tensor`s (see the module doc); `bias` is `[n]`.
pub fn mixed_matmul<B: Backend, const D: usize>(
    lhs: Tensor<B, D>,
    rhs: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
    spec: MixedMatmul,
) -> Tensor<B, D> {
    let primitive = |t: Tensor<B, D>| t.into_primitive().tensor();
    let [lhs, rhs] = [lhs, rhs].map(primitive);
    let output = match bias {
        None => on_cube(&spec, [lhs, rhs])
            .map(|[out]| out)
            .map_err(|[l, r]| (l, r, None)),
        Some(bias) => {
            let bias = bias.into_primitive().tensor();
            on_cube(&spec, [lhs, rhs, bias])
                .map(|[out]| out)
                .map_err(|[l, r, b]| (l, r, Some(b)))
        }
    };
    match output {
        Ok(output) => Tensor::from_primitive(TensorPrimitive::Float(output)),
        Err((lhs, rhs, bias)) => {
            let float = |t| Tensor::<B, D>::from_primitive(TensorPrimitive::Float(t));
            let bias = bias.map(|b| Tensor::from_primitive(TensorPrimitive::Float(b)));
            reference(float(lhs), float(rhs), bias, spec)
        }
    }
}

/// The reference: rounding to the compute type, then the backend's matmul and the epilogue in
/// f32.
pub fn reference<B: Backend, const D: usize>(
    lhs: Tensor<B, D>,
    rhs: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
    spec: MixedMatmul,
) -> Tensor<B, D> {
    let primitive = |t: Tensor<B, D>| t.into_primitive().tensor();
    let product = rounded_product::<B>(primitive(lhs), primitive(rhs), spec.compute);
    let mut out = Tensor::<B, D>::from_primitive(TensorPrimitive::Float(product));
    if let Some(bias) = bias {
        out = out + super::in_dtype(bias, FloatDType::F32).unsqueeze();
    }
    if spec.gelu {
        out = super::gelu_tanh_f32(out);
    }
    super::in_dtype(out, spec.output)
}

/// The policy's matmul on primitives of any rank: `r(lhs)·r(rhs)` in f32, returned in `lhs`'s
/// type (no epilogue). `Parallel<B>::float_matmul` calls it when the policy is on.
pub(crate) fn policy_matmul<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    compute: FloatDType,
) -> FloatTensor<B> {
    let output = FloatDType::from(lhs.dtype());
    let spec = MixedMatmul {
        compute,
        output,
        gelu: false,
    };
    match on_cube(&spec, [lhs, rhs]) {
        Ok([out]) => out,
        Err([lhs, rhs]) => B::float_cast(rounded_product::<B>(lhs, rhs, compute), output),
    }
}

/// `r(lhs)·r(rhs)` in f32 with the backend's own matmul, `r` the rounding to `compute`: the
/// reference's product.
fn rounded_product<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    compute: FloatDType,
) -> FloatTensor<B> {
    let round = |t| B::float_cast(B::float_cast(t, compute), FloatDType::F32);
    B::float_matmul(round(lhs), round(rhs))
}

/// The CubeCL kernel and its launch.
mod cube {
    use burn::tensor::{DType, Shape};
    use burn_cubecl::CubeRuntime;
    use burn_cubecl::kernel::{cast, into_contiguous};
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::prelude::*;

    use super::MixedMatmul;
    use crate::kernels::route::{CubeKernel, LOOP_ITERATION_CAP, loops_capped};

    /// `x` is finite and `e^x` does not overflow f32 below this; GELU's exponent is clamped to it.
    const GELU_EXPONENT_CLAMP: f32 = 80.0;

    /// GPT-2's GELU in f32 (the form of `gelu_tanh_f32`).
    #[cube]
    fn gelu(x: f32) -> f32 {
        let exponent = -2.0f32 * 0.797_884_6f32 * (x + 0.044715f32 * x * x * x);
        x / (1.0f32 + min(exponent, f32::new(GELU_EXPONENT_CLAMP)).exp())
    }

    /// Units per cube side.
    const BLOCK: usize = 16;
    /// Output rows (and columns) a unit computes: `TILE × TILE` outputs, `BLOCK` apart.
    const TILE: usize = 4;
    /// Output rows (and columns) per cube.
    const CUBE_SIDE: usize = BLOCK * TILE;

    /// A unit computes the `TILE × TILE` outputs `out[b, y + BLOCK·i, x + BLOCK·j]` of its
    /// cube's block, `g(Σₗ lhs[b, ·, l]·rhs[b, l, ·] + bias[·])` in f32, summed in order of `l`:
    /// per `l`, `TILE` loads from each operand feed `TILE²` products. Neighbouring units take
    /// neighbouring columns, so their loads from `rhs` and stores are contiguous. A batch
    /// stride of 0 broadcasts that operand over the batch.
    #[cube(launch_unchecked)]
    #[allow(clippy::too_many_arguments)]
    fn mixed_matmul_kernel<F: Float, O: Float>(
        lhs: &Tensor<F>,
        rhs: &Tensor<F>,
        bias: &Tensor<f32>,
        out: &mut Tensor<O>,
        rows: usize,
        inner: usize,
        columns: usize,
        lhs_batch_stride: usize,
        rhs_batch_stride: usize,
        #[comptime] has_bias: bool,
        #[comptime] apply_gelu: bool,
        #[define(F, O)] _dtypes: [StorageType; 2],
    ) {
        let batch = CUBE_POS_Z as usize;
        let first_row = CUBE_POS_Y as usize * CUBE_SIDE + UNIT_POS_Y as usize;
        let first_column = CUBE_POS_X as usize * CUBE_SIDE + UNIT_POS_X as usize;
        let lhs_start = batch * lhs_batch_stride;
        let rhs_start = batch * rhs_batch_stride;

        // Outputs past the edge read the last row or column again and are never written.
        let mut lhs_rows = Array::<usize>::new(TILE);
        let mut rhs_columns = Array::<usize>::new(TILE);
        #[unroll]
        for t in 0..TILE {
            lhs_rows[t] = lhs_start + min(first_row + t * BLOCK, rows - 1) * inner;
            rhs_columns[t] = rhs_start + min(first_column + t * BLOCK, columns - 1);
        }
        let mut sums = Array::<f32>::new(TILE * TILE);
        #[unroll]
        for t in 0..TILE * TILE {
            sums[t] = 0.0;
        }
        let mut a = Array::<f32>::new(TILE);
        let mut b = Array::<f32>::new(TILE);
        for l in 0..inner {
            #[unroll]
            for t in 0..TILE {
                a[t] = f32::cast_from(lhs[lhs_rows[t] + l]);
                b[t] = f32::cast_from(rhs[rhs_columns[t] + l * columns]);
            }
            #[unroll]
            for i in 0..TILE {
                #[unroll]
                for j in 0..TILE {
                    sums[i * TILE + j] += a[i] * b[j];
                }
            }
        }

        #[unroll]
        for i in 0..TILE {
            #[unroll]
            for j in 0..TILE {
                let (row, column) = (first_row + i * BLOCK, first_column + j * BLOCK);
                let mut value = sums[i * TILE + j];
                if has_bias {
                    value += bias[min(column, columns - 1)];
                }
                if apply_gelu {
                    value = gelu(value);
                }
                if row < rows && column < columns {
                    out[(batch * rows + row) * columns + column] = O::cast_from(value);
                }
            }
        }
    }

    /// The kernel on `lhs [.., m, k]`, `rhs [.., k, n]` and `bias [n]` (cast to the compute
    /// type and f32 here), or why it does not take them: a dtype outside f32, f16 and bf16 or
    /// one the device lacks, an empty dim, batch dims that neither match nor are all 1 on one
    /// side, or mismatched shapes.
    pub fn kernel<R: CubeRuntime>(
        lhs: CubeTensor<R>,
        rhs: CubeTensor<R>,
        bias: Option<CubeTensor<R>>,
        spec: MixedMatmul,
    ) -> Result<CubeTensor<R>, String> {
        let geometry = checked_geometry(&spec, &lhs, &rhs, bias.as_ref())?;
        let compute = DType::from(spec.compute);
        let to = |t: CubeTensor<R>, dtype: DType| match t.dtype == dtype {
            true => into_contiguous(t),
            false => into_contiguous(cast(t, dtype)),
        };
        let (lhs, rhs) = (to(lhs, compute), to(rhs, compute));
        let has_bias = bias.is_some();
        // Without a bias the kernel reads none; one element stands in for the binding.
        let bias = match bias {
            Some(bias) => to(bias, DType::F32),
            None => empty_device_contiguous_dtype(
                lhs.client.clone(),
                lhs.device.clone(),
                Shape::new([1]),
                DType::F32,
            ),
        };
        let output_dtype = DType::from(spec.output);
        let out = empty_device_contiguous_dtype(
            lhs.client.clone(),
            lhs.device.clone(),
            geometry.output_shape.clone(),
            output_dtype,
        );
        let cubes = CubeCount::Static(
            geometry.columns.div_ceil(CUBE_SIDE) as u32,
            geometry.rows.div_ceil(CUBE_SIDE) as u32,
            geometry.batches as u32,
        );
        // SAFETY: the tensors are contiguous with the shapes `Geometry` read; reads are clamped to
        // the last row and column, writes skipped past them, and a batch stride is 0 only for an
        // operand with one batch.
        unsafe {
            mixed_matmul_kernel::launch_unchecked(
                &lhs.client.clone(),
                cubes,
                CubeDim::new_2d(BLOCK as u32, BLOCK as u32),
                lhs.into_tensor_arg(),
                rhs.into_tensor_arg(),
                bias.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                geometry.rows,
                geometry.inner,
                geometry.columns,
                geometry.lhs_batch_stride,
                geometry.rhs_batch_stride,
                has_bias,
                spec.gelu,
                [compute.into(), output_dtype.into()],
            )
        };
        Ok(out)
    }

    /// [`kernel`] for the router: `None` (logged) sends the call to the reference.
    fn launch<R: CubeRuntime>(
        spec: &MixedMatmul,
        lhs: CubeTensor<R>,
        rhs: CubeTensor<R>,
        bias: Option<CubeTensor<R>>,
    ) -> Option<CubeTensor<R>> {
        kernel(lhs, rhs, bias, *spec)
            .inspect_err(|reason| {
                log::debug!("mixed-precision matmul runs the reference: {reason}")
            })
            .ok()
    }

    /// The kernel's view of the inputs, or why it cannot take them.
    fn checked_geometry<R: CubeRuntime>(
        spec: &MixedMatmul,
        lhs: &CubeTensor<R>,
        rhs: &CubeTensor<R>,
        bias: Option<&CubeTensor<R>>,
    ) -> Result<Geometry, String> {
        let kernel_types = [DType::F32, DType::F16, DType::BF16];
        let properties = lhs.client.properties();
        for dtype in [
            lhs.dtype,
            rhs.dtype,
            spec.compute.into(),
            spec.output.into(),
        ] {
            if !kernel_types.contains(&dtype) {
                return Err(format!("dtype {dtype:?} (f32, f16 and bf16 are supported)"));
            }
            if !properties.supports_type(dtype) {
                return Err(format!("the device has no {dtype:?} arithmetic"));
            }
        }
        let Some(geometry) = Geometry::of(lhs.meta.shape(), rhs.meta.shape()) else {
            return Err(format!(
                "shapes {:?} × {:?} (batch dims equal or one side's all 1, m, k, n ≥ 1)",
                lhs.meta.shape(),
                rhs.meta.shape()
            ));
        };
        if loops_capped::<R>() && geometry.inner > LOOP_ITERATION_CAP {
            return Err(format!(
                "inner dim {} needs as many loop iterations per invocation, over the \
                 {LOOP_ITERATION_CAP} lavapipe allows on wgpu",
                geometry.inner
            ));
        }
        if let Some(bias) = bias {
            let shape = bias.meta.shape();
            if shape.num_dims() != 1 || shape[0] != geometry.columns {
                return Err(format!("bias {shape:?} for {} columns", geometry.columns));
            }
        }
        Ok(geometry)
    }

    /// The kernel's view of `[.., m, k] × [.., k, n]`.
    struct Geometry {
        rows: usize,
        inner: usize,
        columns: usize,
        batches: usize,
        lhs_batch_stride: usize,
        rhs_batch_stride: usize,
        output_shape: Shape,
    }

    impl Geometry {
        /// `None` for shapes the kernel leaves to the reference: empty dims, a mismatched inner
        /// dim, or batch dims that neither match nor are all 1 on one side.
        fn of(lhs: &Shape, rhs: &Shape) -> Option<Self> {
            let rank = lhs.num_dims();
            if rank < 2
                || rhs.num_dims() != rank
                || lhs.num_elements() == 0
                || rhs.num_elements() == 0
            {
                return None;
            }
            let (rows, inner, columns) = (lhs[rank - 2], lhs[rank - 1], rhs[rank - 1]);
            if rhs[rank - 2] != inner {
                return None;
            }
            let batch_dims = |shape: &Shape| (0..rank - 2).map(|i| shape[i]).collect::<Vec<_>>();
            let (lhs_batch, rhs_batch) = (batch_dims(lhs), batch_dims(rhs));
            let count = |dims: &[usize]| dims.iter().product::<usize>();
            let output_batch = match (count(&lhs_batch), count(&rhs_batch)) {
                _ if lhs_batch == rhs_batch => lhs_batch.clone(),
                (1, _) => rhs_batch.clone(),
                (_, 1) => lhs_batch.clone(),
                _ => return None,
            };
            let batches = count(&output_batch);
            let stride = |dims: &[usize], size: usize| if count(dims) == 1 { 0 } else { size };
            let mut output_shape = output_batch;
            output_shape.extend([rows, columns]);
            Some(Self {
                rows,
                inner,
                columns,
                batches,
                lhs_batch_stride: stride(&lhs_batch, rows * inner),
                rhs_batch_stride: stride(&rhs_batch, inner * columns),
                output_shape: Shape::from(output_shape),
            })
        }
    }

    impl CubeKernel<2, 1> for MixedMatmul {
        fn launch<R: CubeRuntime>(
            &self,
            [lhs, rhs]: [CubeTensor<R>; 2],
        ) -> Option<[CubeTensor<R>; 1]> {
            launch(self, lhs, rhs, None).map(|out| [out])
        }
    }

    impl CubeKernel<3, 1> for MixedMatmul {
        fn launch<R: CubeRuntime>(
            &self,
            [lhs, rhs, bias]: [CubeTensor<R>; 3],
        ) -> Option<[CubeTensor<R>; 1]> {
            launch(self, lhs, rhs, Some(bias)).map(|out| [out])
        }
    }
}
