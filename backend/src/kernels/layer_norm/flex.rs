//! LayerNorm as native loops on Flex in f32: [`super`]'s forward and backward, one pass over
//! each row (two for its statistics), rows in parallel.
//!
//! Inputs of another type (f16, bf16) run the reference.

use burn::tensor::Shape;
use burn_flex::FlexTensor;

use crate::kernels::flex::{par_written, readable_f32, rows_per_task, tensor_f32, vectorised};

/// `x: [.., n]` and the `[n]` parameters `params` as contiguous f32 tensors, and `n`; `None`
/// unless all are f32, `n > 0`, every parameter is `[n]` and every `like_x` has `x`'s shape.
fn rows_and_parameters<const P: usize, const L: usize>(
    x: FlexTensor,
    params: [FlexTensor; P],
    like_x: [FlexTensor; L],
) -> Option<(FlexTensor, [FlexTensor; P], [FlexTensor; L], usize)> {
    let shape = x.layout().shape().clone();
    let columns = shape[shape.num_dims() - 1];
    let fits = columns > 0
        && params
            .iter()
            .all(|p| *p.layout().shape() == Shape::new([columns]))
        && like_x.iter().all(|t| *t.layout().shape() == shape);
    if !fits {
        return None;
    }
    let contiguous = |t: FlexTensor| readable_f32(t).map(|t| t.to_contiguous());
    let x = contiguous(x)?;
    let params = params.map(contiguous);
    let like_x = like_x.map(contiguous);
    if params.iter().chain(&like_x).any(Option::is_none) {
        return None;
    }
    Some((
        x,
        params.map(Option::unwrap),
        like_x.map(Option::unwrap),
        columns,
    ))
}

/// `Σ f(aᵢ, bᵢ)` over two slices of one length, accumulated in 16 lanes so that the loop
/// vectorises (a single running sum would fix the order of the additions), then summed.
#[inline(always)]
fn lane_sum(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    const LANES: usize = 16;
    let mut lanes = [0.0f32; LANES];
    let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let rest: f32 = (a_chunks.remainder().iter().zip(b_chunks.remainder()))
        .map(|(&a, &b)| f(a, b))
        .sum();
    for (a, b) in a_chunks.zip(b_chunks) {
        for k in 0..LANES {
            lanes[k] += f(a[k], b[k]);
        }
    }
    lanes.iter().sum::<f32>() + rest
}

/// A row's mean `μ` and `r = 1/√(σ² + ε)`, the variance around the mean (two passes); for
/// RMSNorm (not `centred`) `μ = 0`, so `σ²` is the mean square.
#[inline(always)]
fn row_statistics(x: &[f32], epsilon: f32, centred: bool) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = match centred {
        true => lane_sum(x, x, |v, _| v) / n,
        false => 0.0,
    };
    let variance = lane_sum(x, x, |v, _| (v - mean) * (v - mean)) / n;
    (mean, 1.0 / (variance + epsilon).sqrt())
}

/// LayerNorm's forward ([`super`]; RMSNorm's when not `centred`), `x̂ ∘ γ + β`, from
/// `[x, γ, β]`, all f32, rows in parallel; `None` for inputs it does not take.
pub fn layer_norm_forward(
    [x, gamma, beta]: [FlexTensor; 3],
    epsilon: f64,
    centred: bool,
) -> Option<[FlexTensor; 1]> {
    let (x, [gamma, beta], [], columns) = rows_and_parameters(x, [gamma, beta], [])?;
    let (xs, gamma, beta) = (
        x.as_slice::<f32>()?,
        gamma.as_slice::<f32>()?,
        beta.as_slice::<f32>()?,
    );
    let epsilon = epsilon as f32;
    let chunk = rows_per_task(columns) * columns;
    // SAFETY: a part is whole rows, each zipped with its row of `x` and with `γ` and `β`, all
    // `columns` long.
    let (out, _) = unsafe {
        par_written(xs.len(), chunk, |index, out| {
            let rows = out
                .chunks_mut(columns)
                .zip(xs[index * chunk..].chunks(columns));
            vectorised(
                #[inline(always)]
                || {
                    for (out, x) in rows {
                        let (mean, r) = row_statistics(x, epsilon, centred);
                        for (((y, x), g), b) in out.iter_mut().zip(x).zip(gamma).zip(beta) {
                            y.write((x - mean) * r * g + b);
                        }
                    }
                },
            )
        })
    };
    Some([tensor_f32(out, x.layout().shape().clone())])
}

/// LayerNorm's backward ([`super`]; RMSNorm's when not `centred`) from `[x, γ, dy]`, all f32:
/// `[dx, dγ, dβ]`.
/// Rows in parallel, each task summing its rows' `dγ` and `dβ`; the tasks' sums are added in
/// task order, so the result does not depend on the number of threads. `None` for inputs it
/// does not take.
pub fn layer_norm_backward(
    [x, gamma, output_grad]: [FlexTensor; 3],
    epsilon: f64,
    centred: bool,
) -> Option<[FlexTensor; 3]> {
    let (x, [gamma], [output_grad], columns) = rows_and_parameters(x, [gamma], [output_grad])?;
    let (xs, gamma, dys) = (
        x.as_slice::<f32>()?,
        gamma.as_slice::<f32>()?,
        output_grad.as_slice::<f32>()?,
    );
    let (epsilon, n) = (epsilon as f32, columns as f32);
    let chunk = rows_per_task(columns) * columns;
    // SAFETY: a part is whole rows, each zipped with its rows of `x` and `dy`, with `g` and
    // `x̂` (all `columns` long).
    let (dx, partial_sums) = unsafe {
        par_written(xs.len(), chunk, |index, dx| {
            let [mut gamma_grad, mut beta_grad, mut normalised, mut g] =
                [(); 4].map(|_| vec![0.0f32; columns]);
            let (xs, dys) = (&xs[index * chunk..], &dys[index * chunk..]);
            vectorised(
                #[inline(always)]
                || {
                    let rows = dx.chunks_mut(columns).zip(xs.chunks(columns));
                    for ((dx, x), dy) in rows.zip(dys.chunks(columns)) {
                        let (mean, r) = row_statistics(x, epsilon, centred);
                        for (((x̂, gi), x), (dy, gamma)) in normalised
                            .iter_mut()
                            .zip(&mut g)
                            .zip(x)
                            .zip(dy.iter().zip(gamma))
                        {
                            *x̂ = (x - mean) * r;
                            *gi = dy * gamma;
                        }
                        let g_mean = match centred {
                            true => lane_sum(&g, &g, |v, _| v) / n,
                            false => 0.0,
                        };
                        let g_normalised_mean = lane_sum(&g, &normalised, |v, x̂| v * x̂) / n;
                        for ((dx, gi), x̂) in dx.iter_mut().zip(&g).zip(&normalised) {
                            dx.write(r * (gi - g_mean - x̂ * g_normalised_mean));
                        }
                        let sums = gamma_grad.iter_mut().zip(&mut beta_grad);
                        for (((dg, db), dy), x̂) in sums.zip(dy).zip(&normalised) {
                            *dg += dy * x̂;
                            *db += dy;
                        }
                    }
                },
            );
            [gamma_grad, beta_grad]
        })
    };
    let [mut gamma_grad, mut beta_grad] = [(); 2].map(|_| vec![0.0f32; columns]);
    for [dg, db] in partial_sums {
        gamma_grad.iter_mut().zip(dg).for_each(|(sum, v)| *sum += v);
        beta_grad.iter_mut().zip(db).for_each(|(sum, v)| *sum += v);
    }
    let parameter = |values| tensor_f32(values, Shape::new([columns]));
    Some([
        tensor_f32(dx, x.layout().shape().clone()),
        parameter(gamma_grad),
        parameter(beta_grad),
    ])
}
