//! The one place wildfire changes what an op does on `Parallel<B>`. (The linear layer's ops
//! are not forwarded at all: they keep Burn's default composition, so that their matmuls come
//! to [`float_matmul`] here; `COMPOSED` in `scripts/gen-decorator.py`.)
//!
//! Every `pub(super) fn` here is an op of one of Burn's op traits, generic over the inner
//! backend `B`, with the op's own parameters. `scripts/gen-decorator.py` makes the op's impl in
//! `forward.rs` call it instead of forwarding to `B`; run the generator again after adding one.

use burn::tensor::DType;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use super::Parallel;
use crate::kernels::flex_matmul;
use crate::kernels::matmul::{matmul_precision, policy_matmul};
use crate::kernels::route::on_flex;

/// Float matmul under the process-wide [`MatmulPrecision`](crate::kernels::matmul::MatmulPrecision)
/// policy: the inner backend's own when it is off (on Flex in f32, the same products without
/// Flex's copy of each output: [`flex_matmul`]); otherwise inputs rounded to bf16 or f16,
/// products accumulated in f32, the result in `lhs`'s type (the mixed-precision kernel on
/// CubeCL backends, its reference elsewhere). Under `Autodiff<Parallel<B>>` the
/// backward's matmuls come here too.
pub(super) fn float_matmul<B: Backend>(
    lhs: FloatTensor<Parallel<B>>,
    rhs: FloatTensor<Parallel<B>>,
) -> FloatTensor<Parallel<B>> {
    match matmul_precision().compute_dtype() {
        None => match on_flex([lhs, rhs], flex_matmul::matmul) {
            Ok([product]) => product,
            Err([lhs, rhs]) => B::float_matmul(lhs, rhs),
        },
        Some(compute) => {
            let device = B::float_device(&lhs);
            assert!(
                B::supports_dtype(&device, DType::from(compute)),
                "matmul precision {compute:?}: device {device:?} has no {compute:?} (set the \
                 policy to off or to a type the device has)"
            );
            policy_matmul::<B>(lhs, rhs, compute)
        }
    }
}
