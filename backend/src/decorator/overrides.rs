//! The one place wildfire changes what an op does on `Parallel<B>`.
//!
//! Every `pub(super) fn` here is an op of one of Burn's op traits, generic over the inner
//! backend `B`, with the op's own parameters. `scripts/gen-decorator.py` makes the op's impl in
//! `forward.rs` call it instead of forwarding to `B`; run the generator again after adding one.

use burn::tensor::backend::{Backend, ExecutionError};
use burn::tensor::ops::{BoolTensor, FloatTensor, IntTensor};
use burn::tensor::{DType, FloatDType, Shape, TensorData, TensorMetadata};

use super::Parallel;
use super::reads::{as_read, count_read};
use crate::kernels::matmul::{self, matmul_precision, policy_matmul};
use crate::kernels::route::on_flex;
use crate::kernels::{self, add};

/// Float matmul under the process-wide [`MatmulPrecision`](crate::kernels::matmul::MatmulPrecision)
/// policy: the inner backend's own when it is off (on Flex in f32, the same products without
/// Flex's copy of each output: [`matmul::flex`]; on CUDA with the vendor tier on, the
/// mixed-precision op in the inputs' own type, whose product cuBLASLt computes:
/// [`matmul::vendor`]); otherwise inputs rounded to bf16 or f16, products accumulated in f32,
/// the result in `lhs`'s type (the mixed-precision kernel on CubeCL backends, its reference
/// elsewhere). Under `Autodiff<Parallel<B>>` the backward's matmuls come here too.
pub(super) fn float_matmul<B: Backend>(
    lhs: FloatTensor<Parallel<B>>,
    rhs: FloatTensor<Parallel<B>>,
) -> FloatTensor<Parallel<B>> {
    match matmul_precision().compute_dtype() {
        None => match on_flex("matmul", [lhs, rhs], matmul::flex::matmul) {
            Ok([product]) => product,
            Err([lhs, rhs]) if matmul::vendor::takes_backend::<B>() => {
                let own = FloatDType::from(lhs.dtype());
                policy_matmul::<B>(lhs, rhs, own)
            }
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

/// `lhs + rhs`: on Flex, contiguous f32 tensors of one shape (at least 128 Ki elements, with
/// more than one thread: the residual stream's adds and the backward's gradient sums), or one
/// repeated along leading dims (a position embedding, a bias) are added on all of rayon's
/// threads ([`add::add`]), where Flex adds on one; the same sums.
pub(super) fn float_add<B: Backend>(
    lhs: FloatTensor<Parallel<B>>,
    rhs: FloatTensor<Parallel<B>>,
) -> FloatTensor<Parallel<B>> {
    match on_flex("add", [lhs, rhs], add::add) {
        Ok([sum]) => sum,
        Err([lhs, rhs]) => B::float_add(lhs, rhs),
    }
}

/// A linear layer, `y = x·W + b` for `x: [.., d_in]`, `W: [d_in, d_out]`, `b: [d_out]`: every
/// row of `x` in one `[n, d_in]·[d_in, d_out]` product through [`float_matmul`] (so the linear
/// layer takes the matmul precision policy), where Burn's default multiplies each batch entry
/// by a broadcast `W`.
pub(super) fn linear<B: Backend>(
    x: FloatTensor<Parallel<B>>,
    weight: FloatTensor<Parallel<B>>,
    bias: Option<FloatTensor<Parallel<B>>>,
) -> FloatTensor<Parallel<B>> {
    let (rows, shape) = as_rows::<B>(x);
    let mut y = float_matmul::<B>(rows, weight);
    if let Some(bias) = bias {
        let width = bias.shape()[0];
        y = float_add::<B>(y, B::float_reshape(bias, Shape::new([1, width])));
    }
    from_rows::<B>(y, shape)
}

/// The linear layer's input gradient `dx = dy·Wᵀ`, all rows in one product.
pub(super) fn linear_x_backward<B: Backend>(
    weight: FloatTensor<Parallel<B>>,
    output_grad: FloatTensor<Parallel<B>>,
) -> FloatTensor<Parallel<B>> {
    let (rows, shape) = as_rows::<B>(output_grad);
    from_rows::<B>(
        float_matmul::<B>(rows, B::float_swap_dims(weight, 0, 1)),
        shape,
    )
}

/// The linear layer's weight gradient `dW = Σᵣ xᵣᵀ dyᵣ` over all `n` rows `r` of every batch
/// entry: one `[d_in, n]·[n, d_out]` product whose inner dimension is the sum, where Burn's
/// default makes one product per batch entry and then sums them.
pub(super) fn linear_weight_backward<B: Backend>(
    x: FloatTensor<Parallel<B>>,
    output_grad: FloatTensor<Parallel<B>>,
) -> FloatTensor<Parallel<B>> {
    let (x_rows, _) = as_rows::<B>(x);
    let (grad_rows, _) = as_rows::<B>(output_grad);
    float_matmul::<B>(B::float_swap_dims(x_rows, 0, 1), grad_rows)
}

/// The linear layer's bias gradient `db = Σᵣ dyᵣ` over all rows, in one sum.
pub(super) fn linear_bias_backward<B: Backend>(
    output_grad: FloatTensor<Parallel<B>>,
) -> FloatTensor<Parallel<B>> {
    let (rows, _) = as_rows::<B>(output_grad);
    let width = rows.shape()[1];
    B::float_reshape(B::float_sum_dim(rows, 0), Shape::new([width]))
}

/// `tensor: [.., d]` as the matrix of its rows ([`kernels::as_rows`]), and its shape. A reshape:
/// no copy when the rows lie contiguously.
fn as_rows<B: Backend>(tensor: FloatTensor<Parallel<B>>) -> (FloatTensor<Parallel<B>>, Shape) {
    let shape = tensor.shape();
    let rows = kernels::as_rows::<Parallel<B>>(tensor);
    (rows.into_primitive().tensor(), shape)
}

/// The inverse of [`as_rows`] for a matrix of other rows: `rows: [n, w]` in the leading
/// dimensions of `shape`, `[.., w]`.
fn from_rows<B: Backend>(
    rows: FloatTensor<Parallel<B>>,
    mut shape: Shape,
) -> FloatTensor<Parallel<B>> {
    let width = rows.shape()[1];
    if let Some(last) = shape.as_mut_slice().last_mut() {
        *last = width;
    }
    B::float_reshape(rows, shape)
}

/// Reading a float tensor to the host: the inner backend's read, counted as one blocking read
/// of this thread, its bytes misaligned where the process asks for that ([`super::reads`]).
pub(super) fn float_into_data<B: Backend>(
    tensor: FloatTensor<Parallel<B>>,
) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
    count_read();
    let (read, as_read) = (B::float_into_data(tensor), as_read());
    async move { read.await.map(as_read) }
}

/// Reading an int tensor to the host, counted as [`float_into_data`] is.
pub(super) fn int_into_data<B: Backend>(
    tensor: IntTensor<Parallel<B>>,
) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
    count_read();
    let (read, as_read) = (B::int_into_data(tensor), as_read());
    async move { read.await.map(as_read) }
}

/// Reading a bool tensor to the host, counted as [`float_into_data`] is.
pub(super) fn bool_into_data<B: Backend>(
    tensor: BoolTensor<Parallel<B>>,
) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
    count_read();
    let (read, as_read) = (B::bool_into_data(tensor), as_read());
    async move { read.await.map(as_read) }
}
