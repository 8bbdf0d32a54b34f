//! The CubeCL path: the product by Burn's own CubeCL matmul, then the epilogue kernel.

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::cast;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};

use super::{MixedMatmul, reference_on};
use crate::kernels::bias_gelu::cube::epilogue;
use crate::kernels::cube_kernel::{CubeKernel, TensorSpec, unsupported_float};

/// The CubeCL path on `lhs [.., m, k]`, `rhs [.., k, n]` and `bias [n]`, or why it does not
/// take them: a dtype outside f32, f16 and bf16 or one the device lacks, an empty dim, batch
/// dims that do not broadcast, or mismatched shapes.
///
/// The inputs are cast to the compute type and multiplied by cuBLASLt where the vendor tier
/// takes them ([`super::vendor`], CUDA only, off by default), else by Burn's CubeCL matmul
/// (cubek-matmul, autotuned in a build with `cuda`; tensor cores where the device has them);
/// both accumulate half-precision inputs in f32 and write the product in f32 when an epilogue
/// follows (the output type otherwise). The epilogue then reads the product once and writes
/// the output.
pub fn kernel<R: CubeRuntime>(
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    spec: MixedMatmul,
) -> Result<CubeTensor<R>, String> {
    let bias_spec = bias.as_ref().map(TensorSpec::of);
    let columns = checked_columns::<R>(
        &spec,
        [&lhs, &rhs].map(TensorSpec::of),
        bias_spec.as_ref(),
        &lhs.device,
    )?;
    let compute = DType::from(spec.compute);
    // `cast` returns a tensor already in `dtype` as it is.
    let [lhs, rhs] = [lhs, rhs].map(|t| cast(t, compute));
    let output = DType::from(spec.output);
    let has_epilogue = bias.is_some() || spec.gelu;
    let product_type = if has_epilogue { DType::F32 } else { output };
    let product = super::vendor::product(lhs, rhs, product_type)?;
    if !has_epilogue {
        return Ok(product);
    }
    Ok(epilogue(product, bias, columns, spec.gelu, output))
}

/// `n`, the product's columns, once the dtypes, the shapes and the bias are ones the CubeCL
/// path takes on `device`; or why they are not.
fn checked_columns<R: CubeRuntime>(
    spec: &MixedMatmul,
    [lhs, rhs]: [TensorSpec; 2],
    bias: Option<&TensorSpec>,
    device: &R::Device,
) -> Result<usize, String> {
    for dtype in [
        lhs.dtype,
        rhs.dtype,
        spec.compute.into(),
        spec.output.into(),
    ] {
        unsupported_float::<R>(dtype, device)?;
    }
    let (lhs_shape, rhs_shape) = (&lhs.shape, &rhs.shape);
    let Some(columns) = product_columns(lhs_shape, rhs_shape) else {
        return Err(format!(
            "shapes {lhs_shape:?} × {rhs_shape:?} (equal ranks ≥ 2, batch dims equal or 1, \
             m, k, n ≥ 1)"
        ));
    };
    if let Some(bias) = bias {
        let shape = &bias.shape;
        if shape.num_dims() != 1 || shape[0] != columns {
            return Err(format!("bias {shape:?} for {columns} columns"));
        }
    }
    Ok(columns)
}

/// The product's shape: `[.., m, n]` with each batch dim the larger of the pair (they are equal
/// or one of them is 1).
fn product_shape(lhs: &Shape, rhs: &Shape) -> Shape {
    let rank = lhs.num_dims();
    let mut dims: Vec<usize> = (0..rank - 2).map(|i| lhs[i].max(rhs[i])).collect();
    dims.extend([lhs[rank - 2], rhs[rank - 1]]);
    Shape::from(dims)
}

/// The columns `n` of `[.., m, k] × [.., k, n]`, or `None` for shapes left to the
/// reference: ranks that differ or are below 2, an empty dim, a mismatched inner dim, or
/// batch dims that do not broadcast (each pair equal, or one of them 1).
fn product_columns(lhs: &Shape, rhs: &Shape) -> Option<usize> {
    let rank = lhs.num_dims();
    if rank < 2
        || rhs.num_dims() != rank
        || lhs.num_elements() == 0
        || rhs.num_elements() == 0
        || lhs[rank - 1] != rhs[rank - 2]
    {
        return None;
    }
    let broadcasts = (0..rank - 2).all(|i| lhs[i] == rhs[i] || lhs[i] == 1 || rhs[i] == 1);
    broadcasts.then_some(rhs[rank - 1])
}

impl MixedMatmul {
    /// [`kernel`] on inputs its check took. Burn's matmul may still decline a product it has no
    /// kernel for (its own checks run at launch, and a queued launch cannot hand the call
    /// back): that product runs the reference on the same device instead, logged.
    fn launch_or_reference<R: CubeRuntime>(
        &self,
        lhs: CubeTensor<R>,
        rhs: CubeTensor<R>,
        bias: Option<CubeTensor<R>>,
    ) -> CubeTensor<R> {
        let inputs = (lhs.clone(), rhs.clone(), bias.clone());
        kernel(lhs, rhs, bias, *self).unwrap_or_else(|reason| {
            log::warn!("{OP} runs the reference: {reason}");
            let (lhs, rhs, bias) = inputs;
            reference_on::<CubeBackend<R, f32, i32, u8>>(lhs, rhs, bias, *self)
        })
    }

    /// The output's shape and type for `[lhs, rhs]` and an optional bias, or why the CubeCL
    /// path does not take them.
    fn output<R: CubeRuntime>(
        &self,
        [lhs, rhs]: [&TensorSpec; 2],
        bias: Option<&TensorSpec>,
        device: &R::Device,
    ) -> Result<[TensorSpec; 1], String> {
        checked_columns::<R>(self, [lhs.clone(), rhs.clone()], bias, device)?;
        let shape = product_shape(&lhs.shape, &rhs.shape);
        Ok([TensorSpec::new(shape, self.output.into())])
    }
}

impl CubeKernel<2, 1> for MixedMatmul {
    fn op(&self) -> &'static str {
        OP
    }

    fn outputs<R: CubeRuntime>(
        &self,
        [lhs, rhs]: &[TensorSpec; 2],
        device: &R::Device,
    ) -> Result<[TensorSpec; 1], String> {
        self.output::<R>([lhs, rhs], None, device)
    }

    fn launch<R: CubeRuntime>(&self, [lhs, rhs]: [CubeTensor<R>; 2]) -> [CubeTensor<R>; 1] {
        [self.launch_or_reference(lhs, rhs, None)]
    }
}

impl CubeKernel<3, 1> for MixedMatmul {
    fn op(&self) -> &'static str {
        OP
    }

    fn outputs<R: CubeRuntime>(
        &self,
        [lhs, rhs, bias]: &[TensorSpec; 3],
        device: &R::Device,
    ) -> Result<[TensorSpec; 1], String> {
        self.output::<R>([lhs, rhs], Some(bias), device)
    }

    fn launch<R: CubeRuntime>(&self, [lhs, rhs, bias]: [CubeTensor<R>; 3]) -> [CubeTensor<R>; 1] {
        [self.launch_or_reference(lhs, rhs, Some(bias))]
    }
}

/// The op's name in the log and the kernel paths' counts.
pub(super) const OP: &str = "mixed-precision matmul";
