//! The inner product the attention kernels are made of, unrolled for lavapipe's loop cap.

use cubecl::prelude::*;

/// Terms of a dot product per loop iteration: the loop is unrolled by this much, so a length-`n`
/// product costs [`dot_iterations`]`(n)` of the iterations lavapipe allows an invocation
/// ([`super::route::LOOP_ITERATION_CAP`]).
pub(crate) const UNROLL: usize = 32;

/// The loop iterations of a length-`len` [`dot`].
pub(crate) fn dot_iterations(len: usize) -> usize {
    len / UNROLL + len % UNROLL
}

/// `Σₖ a[a_start + k·a_stride]·b[b_start + k·b_stride]` for `k < len`, in f32, in order of `k`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dot<F: Float>(
    a: &Tensor<F>,
    a_start: usize,
    a_stride: usize,
    b: &Tensor<F>,
    b_start: usize,
    b_stride: usize,
    len: usize,
) -> f32 {
    let mut sum = 0.0f32;
    let whole = len / UNROLL * UNROLL;
    for base in range_stepped(0, whole, UNROLL) {
        #[unroll]
        for k in 0..UNROLL {
            let i = base + k;
            sum += f32::cast_from(a[a_start + i * a_stride])
                * f32::cast_from(b[b_start + i * b_stride]);
        }
    }
    for i in whole..len {
        sum +=
            f32::cast_from(a[a_start + i * a_stride]) * f32::cast_from(b[b_start + i * b_stride]);
    }
    sum
}
