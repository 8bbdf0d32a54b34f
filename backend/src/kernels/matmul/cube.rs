//! The CubeCL path: the product by Burn's own CubeCL matmul, then the epilogue kernel.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::cast;
use burn_cubecl::kernel::matmul::{MatmulStrategy, matmul};
use burn_cubecl::tensor::CubeTensor;

use super::MixedMatmul;
use crate::kernels::bias_gelu::cube::epilogue;
use crate::kernels::route::CubeKernel;

/// The CubeCL path on `lhs [.., m, k]`, `rhs [.., k, n]` and `bias [n]`, or why it does not
/// take them: a dtype outside f32, f16 and bf16 or one the device lacks, an empty dim, batch
/// dims that do not broadcast, or mismatched shapes.
///
/// The inputs are cast to the compute type and multiplied by Burn's CubeCL matmul
/// (cubek-matmul, autotuned; tensor cores where the device has them), which accumulates
/// half-precision inputs in f32 and writes the product in f32 when an epilogue follows (the
/// output type otherwise). The epilogue then reads the product once and writes the output.
pub fn kernel<R: CubeRuntime>(
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    spec: MixedMatmul,
) -> Result<CubeTensor<R>, String> {
    let columns = checked_columns(&spec, &lhs, &rhs, bias.as_ref())?;
    let compute = DType::from(spec.compute);
    // `cast` returns a tensor already in `dtype` as it is.
    let [lhs, rhs] = [lhs, rhs].map(|t| cast(t, compute));
    let output = DType::from(spec.output);
    let has_epilogue = bias.is_some() || spec.gelu;
    let product_type = if has_epilogue { DType::F32 } else { output };
    let product = matmul(lhs, rhs, None, MatmulStrategy::default(), product_type)
        .map_err(|error| format!("Burn's CubeCL matmul declined: {error}"))?;
    if !has_epilogue {
        return Ok(product);
    }
    Ok(epilogue(product, bias, columns, spec.gelu, output))
}

/// [`kernel`] for the router: `None` (logged) sends the call to the reference.
fn launch<R: CubeRuntime>(
    spec: &MixedMatmul,
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
) -> Option<CubeTensor<R>> {
    kernel(lhs, rhs, bias, *spec)
        .inspect_err(|reason| log::debug!("mixed-precision matmul runs the reference: {reason}"))
        .ok()
}

/// `n`, the product's columns, once the dtypes, the shapes and the bias are ones the CubeCL
/// path takes; or why they are not.
fn checked_columns<R: CubeRuntime>(
    spec: &MixedMatmul,
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    bias: Option<&CubeTensor<R>>,
) -> Result<usize, String> {
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
    let (lhs_shape, rhs_shape) = (lhs.meta.shape(), rhs.meta.shape());
    let Some(columns) = product_columns(lhs_shape, rhs_shape) else {
        return Err(format!(
            "shapes {lhs_shape:?} × {rhs_shape:?} (equal ranks ≥ 2, batch dims equal or 1, \
             m, k, n ≥ 1)"
        ));
    };
    if let Some(bias) = bias {
        let shape = bias.meta.shape();
        if shape.num_dims() != 1 || shape[0] != columns {
            return Err(format!("bias {shape:?} for {columns} columns"));
        }
    }
    Ok(columns)
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

impl CubeKernel<2, 1> for MixedMatmul {
    fn launch<R: CubeRuntime>(&self, [lhs, rhs]: [CubeTensor<R>; 2]) -> Option<[CubeTensor<R>; 1]> {
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
