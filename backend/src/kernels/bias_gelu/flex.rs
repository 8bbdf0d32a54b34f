//! Bias + GELU as native loops on Flex in f32: `y = g(x + b)` and `dx = dy ∘ g'(x + b)`
//! elementwise, rows in parallel, with [`super`]'s `g` and `g'` (the clamped exponent included)
//! and the shared vectorised [`exp`](crate::kernels::flex::exp).
//!
//! Inputs of another type (f16, bf16) run the reference.

use burn_flex::FlexTensor;

use crate::kernels::flex::{exp, par_written, readable_f32, rows_per_task, tensor_f32, vectorised};
use crate::kernels::{GELU_A, GELU_C, GELU_EXPONENT_CLAMP};

/// GELU's exponent `E = −2c(z + a·z³)`, in f32 as the kernels compute it.
#[inline(always)]
fn gelu_exponent(z: f32) -> f32 {
    -2.0 * GELU_C as f32 * (z + GELU_A as f32 * z * z * z)
}

/// `g(z) = z / (1 + e^min(E, 80))`.
#[inline(always)]
fn gelu(z: f32) -> f32 {
    z / (1.0 + exp(gelu_exponent(z).min(GELU_EXPONENT_CLAMP as f32)))
}

/// `g'(z)` of the clamped form: `s + z·s(1 − s)·2c(1 + 3a·z²)` below the clamp, `s` at it.
#[inline(always)]
fn gelu_slope(z: f32) -> f32 {
    let exponent = gelu_exponent(z);
    let clamp = GELU_EXPONENT_CLAMP as f32;
    let s = 1.0 / (1.0 + exp(exponent.min(clamp)));
    if exponent < clamp {
        let growth = 1.0 + 3.0 * GELU_A as f32 * z * z;
        s + z * s * (1.0 - s) * 2.0 * GELU_C as f32 * growth
    } else {
        s
    }
}

/// `f(x[r, c] + b[c], other[r, c])` for every element of `x: [.., n]` (and of `other`, its
/// shape, when given), as a new f32 tensor of `x`'s shape; `None` unless all are f32, `n > 0`
/// and `b` is `[n]`.
fn biased_elementwise(
    x: FlexTensor,
    bias: FlexTensor,
    other: Option<FlexTensor>,
    f: impl Fn(f32, f32) -> f32 + Sync,
) -> Option<FlexTensor> {
    let shape = x.layout().shape().clone();
    let columns = shape[shape.num_dims() - 1];
    let bias_shape = bias.layout().shape();
    let fits = columns > 0
        && bias_shape.num_dims() == 1
        && bias_shape[0] == columns
        && other
            .as_ref()
            .is_none_or(|other| *other.layout().shape() == shape);
    if !fits {
        return None;
    }
    let contiguous = |t: FlexTensor| readable_f32(t).map(|t| t.to_contiguous());
    let (x, bias) = (contiguous(x)?, contiguous(bias)?);
    let other = match other {
        Some(other) => Some(contiguous(other)?),
        None => None,
    };
    let (xs, bs) = (x.as_slice::<f32>()?, bias.as_slice::<f32>()?);
    // Without `other`, `f` is given `x` again in its place, and ignores it.
    let others = match &other {
        Some(other) => other.as_slice::<f32>()?,
        None => xs,
    };
    let chunk = rows_per_task(columns) * columns;
    // SAFETY: a part is whole rows of `columns` (`chunk` is a multiple of it), and each row's
    // elements are zipped with the same row of `x`, of `other` and with `b`, all `columns` long.
    let (out, _) = unsafe {
        par_written(xs.len(), chunk, |index, out| {
            let rows = out
                .chunks_mut(columns)
                .zip(xs[index * chunk..].chunks(columns))
                .zip(others[index * chunk..].chunks(columns));
            vectorised(
                #[inline(always)]
                || {
                    for ((out, xs), others) in rows {
                        for (((y, x), b), o) in out.iter_mut().zip(xs).zip(bs).zip(others) {
                            y.write(f(x + b, *o));
                        }
                    }
                },
            );
        })
    };
    Some(tensor_f32(out, shape))
}

/// `g(x + b)` on `x: [.., n]` and `b: [n]`, both f32.
pub fn bias_gelu_forward([x, bias]: [FlexTensor; 2]) -> Option<[FlexTensor; 1]> {
    biased_elementwise(x, bias, None, |z, _| gelu(z)).map(|y| [y])
}

/// `dx = dy ∘ g'(x + b)` from `[x, b, dy]`, all f32.
pub fn bias_gelu_backward([x, bias, output_grad]: [FlexTensor; 3]) -> Option<[FlexTensor; 1]> {
    biased_elementwise(x, bias, Some(output_grad), |z, dy| dy * gelu_slope(z)).map(|dx| [dx])
}
