//! What the CubeCL kernels' launches share: their output buffers, the grid of an elementwise
//! launch, and the launch of inputs a kernel's check accepted.

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

/// The outputs of a kernel launched on inputs its acceptance check took
/// ([`super::route::CubeKernel::outputs`]), which runs the same checks on the same shapes and
/// types and so cannot decline them.
///
/// # Panics
/// If it declines them all the same: the two checks disagree, a bug.
pub(crate) fn accepted<T>(op: &str, result: Result<T, String>) -> T {
    result.unwrap_or_else(|reason| {
        panic!("{op}: the kernel declined inputs its acceptance check took: {reason}")
    })
}
