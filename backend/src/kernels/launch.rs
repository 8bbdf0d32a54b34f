//! What the CubeCL kernels' launches share: their output buffers, the grid of an elementwise
//! launch, and the router's fallback when a kernel declines its inputs.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

/// An empty contiguous tensor of `shape` and `dtype` on `like`'s device.
pub(crate) fn empty_on<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: Shape,
    dtype: DType,
) -> CubeTensor<R> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}

/// An empty contiguous tensor of `like`'s shape, type and device.
pub(crate) fn empty_like<R: CubeRuntime>(like: &CubeTensor<R>) -> CubeTensor<R> {
    empty_on(like, like.meta.shape().clone(), like.dtype)
}

/// The cube count and cube dim of a launch with one unit per element of `out`.
pub(crate) fn elementwise_grid<R: CubeRuntime>(out: &CubeTensor<R>) -> (CubeCount, CubeDim) {
    let elements = out.meta.shape().num_elements();
    let cube_dim = CubeDim::new(&out.client, elements);
    let cubes = calculate_cube_count_elemwise(&out.client, elements, cube_dim);
    (cubes, cube_dim)
}

/// A kernel's outputs for the router: an error, logged as `op` running the reference, sends
/// the call to the reference.
pub(crate) fn routed<T>(op: &str, result: Result<T, String>) -> Option<T> {
    result
        .inspect_err(|reason| log::debug!("{op} runs the reference: {reason}"))
        .ok()
}
