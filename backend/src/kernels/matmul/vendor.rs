//! The vendor tier of the matmuls: cuBLASLt's GEMM ([`crate::cuda::cublaslt`]) for CUDA
//! tensors, ahead of Burn's CubeCL matmul, which runs whatever the tier does not take.
//!
//! **Off by default.** It has not yet passed its GPU tests on a GPU, so it runs only where asked:
//! `WILDFIRE_CUBLASLT=1` (or [`set_vendor_matmul`]`(true)`). On, every float matmul of
//! `Parallel<B>` over a CUDA backend (bare or fused) goes through the mixed-precision op with its
//! own type as the compute type, whose product step asks this tier first: plain products in
//! their type, the mixed-precision policy's rounded ones, and the backward's.
//!
//! **What it takes**: the types [`gemm_types`](super::gemm_plan::gemm_types) takes (f32 inputs
//! as full f32 products unless the policy is `tf32`: `CUBLAS_COMPUTE_32F_FAST_TF32`, PyTorch's
//! `set_float32_matmul_precision("high")`). Operands whose strides would need a copy, a missing
//! library, or a call the library refuses go to Burn's CubeCL matmul instead, the first reason logged (`kernels: matmul (cuBLASLt)'s kernel
//! declined a call: ...`), every call counted by path ([`super::super::route::kernel_paths`]).

use std::sync::atomic::{AtomicU8, Ordering};

use burn::tensor::DType;
use burn::tensor::backend::Backend;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::matmul::{MatmulStrategy, matmul};
use burn_cubecl::tensor::CubeTensor;

use crate::kernels::route::cube_runtime;

/// The op's name in the log and the kernel paths' counts.
pub const OP: &str = "matmul (cuBLASLt)";

static VENDOR: AtomicU8 = AtomicU8::new(UNDECIDED);
const UNDECIDED: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

/// Whether the vendor tier runs: as [`set_vendor_matmul`] last said, else as
/// `WILDFIRE_CUBLASLT` says (`1` on; unset or `0` off; read once).
///
/// # Panics
/// On any other value of `WILDFIRE_CUBLASLT`, naming it.
pub fn vendor_matmul() -> bool {
    if VENDOR.load(Ordering::Relaxed) == UNDECIDED {
        let from_env = match std::env::var("WILDFIRE_CUBLASLT").as_deref() {
            Err(_) | Ok("0") => OFF,
            Ok("1") => ON,
            Ok(other) => panic!("WILDFIRE_CUBLASLT={other:?}: expected 1 (on) or 0 (off)"),
        };
        let _ = VENDOR.compare_exchange(UNDECIDED, from_env, Ordering::Relaxed, Ordering::Relaxed);
    }
    VENDOR.load(Ordering::Relaxed) == ON
}

/// Turns the vendor tier on or off in this process, whatever `WILDFIRE_CUBLASLT` says.
pub fn set_vendor_matmul(on: bool) {
    VENDOR.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

/// Whether `B`'s float matmuls go to the vendor tier: it is on and `B`'s tensors are CUDA
/// tensors, bare or in Burn's fusion stream.
pub(crate) fn takes_backend<B: Backend>() -> bool {
    vendor_matmul() && cube_runtime::<B::FloatTensorPrimitive>() == Some("cuda")
}

/// `lhs · rhs` in `output` on a CubeCL runtime: cuBLASLt where the vendor tier is on, the
/// runtime is CUDA and it takes the call; Burn's CubeCL matmul otherwise (or `Err` when that
/// declines too).
pub(crate) fn product<R: CubeRuntime>(
    lhs: CubeTensor<R>,
    rhs: CubeTensor<R>,
    output: DType,
) -> Result<CubeTensor<R>, String> {
    #[cfg(feature = "cuda")]
    if let Some(taken) = on_cublaslt(&lhs, &rhs, output) {
        use crate::kernels::route::{KernelPath, declined, record};
        match taken {
            Ok(product) => {
                record(OP, KernelPath::Vendor);
                return Ok(product);
            }
            Err(reason) => declined(OP, &reason),
        }
    }
    matmul(lhs, rhs, None, MatmulStrategy::default(), output)
        .map_err(|error| format!("Burn's CubeCL matmul declined: {error}"))
}

/// cuBLASLt's product when the tier is on and `R` is CUDA (`None` otherwise): the product, or
/// why the library did not take it.
#[cfg(feature = "cuda")]
fn on_cublaslt<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    output: DType,
) -> Option<Result<CubeTensor<R>, String>> {
    use cubecl::cuda::CudaRuntime;
    type CudaTensor = CubeTensor<CudaRuntime>;
    if !vendor_matmul() {
        return None;
    }
    let (lhs, rhs): (&dyn std::any::Any, &dyn std::any::Any) = (lhs, rhs);
    let (lhs, rhs) = (
        lhs.downcast_ref::<CudaTensor>()?,
        rhs.downcast_ref::<CudaTensor>()?,
    );
    let run = || {
        let precision = super::matmul_precision();
        let types = super::gemm_plan::gemm_types(lhs.dtype, rhs.dtype, output, precision)?;
        crate::cuda::cublaslt::matmul(lhs, rhs, types)
    };
    Some(run().map(crate::typecast::same::<CudaTensor, CubeTensor<R>>))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tier_switches_and_never_takes_another_backend() {
        // The flag is process-wide; this test is the only one that sets it.
        set_vendor_matmul(false);
        assert!(!vendor_matmul());
        set_vendor_matmul(true);
        assert!(vendor_matmul());
        assert!(
            !takes_backend::<burn::backend::Flex>(),
            "Flex's matmuls never go to the vendor tier"
        );
        set_vendor_matmul(false);
    }
}
