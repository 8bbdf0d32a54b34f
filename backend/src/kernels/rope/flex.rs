//! The rotary embedding as native loops on Flex in f32 ([`super`]'s op), positions in parallel.
//!
//! Inputs of another type (f16, bf16) run the reference.

use burn::tensor::Shape;
use burn_flex::FlexTensor;

use crate::kernels::flex::{par_written, readable_f32, rows_per_task, tensor_f32, vectorised};

/// `x ∘ cos + rot(x) ∘ sin` from `[x, cos, sin]` (`[batch, seq, heads, d]`, `[seq, d]` twice),
/// all f32; `None` for inputs it does not take (another type, an odd or zero `d`, tables of
/// another shape).
pub fn rope([x, cos, sin]: [FlexTensor; 3]) -> Option<[FlexTensor; 1]> {
    let shape = x.layout().shape().clone();
    if shape.num_dims() != 4 {
        return None;
    }
    let (seq, heads, width) = (shape[1], shape[2], shape[3]);
    let table_shape = Shape::new([seq, width]);
    let fits = width > 0
        && width.is_multiple_of(2)
        && *cos.layout().shape() == table_shape
        && *sin.layout().shape() == table_shape;
    if !fits {
        return None;
    }
    let contiguous = |t: FlexTensor| readable_f32(t).map(|t| t.to_contiguous());
    let (x, cos, sin) = (contiguous(x)?, contiguous(cos)?, contiguous(sin)?);
    let (xs, cos, sin) = (
        x.as_slice::<f32>()?,
        cos.as_slice::<f32>()?,
        sin.as_slice::<f32>()?,
    );
    let (half, row) = (width / 2, heads * width);
    let chunk = rows_per_task(row) * row;
    // SAFETY: a part is whole rows (one position of one sequence: `heads` heads of `width`),
    // each zipped with its row of `x`; `position` indexes rows of the `[seq, width]` tables.
    let (out, _) = unsafe {
        par_written(xs.len(), chunk, |index, out| {
            let first_row = index * chunk / row;
            let rows = out.chunks_mut(row).zip(xs[index * chunk..].chunks(row));
            vectorised(
                #[inline(always)]
                || {
                    for (r, (out, x)) in rows.enumerate() {
                        let position = (first_row + r) % seq;
                        let table = position * width..(position + 1) * width;
                        let (cos, sin) = (&cos[table.clone()], &sin[table]);
                        let (cos_1, cos_2) = cos.split_at(half);
                        let (sin_1, sin_2) = sin.split_at(half);
                        for (out, x) in out.chunks_mut(width).zip(x.chunks(width)) {
                            let (x_1, x_2) = x.split_at(half);
                            let (out_1, out_2) = out.split_at_mut(half);
                            for i in 0..half {
                                out_1[i].write(x_1[i] * cos_1[i] + -x_2[i] * sin_1[i]);
                                out_2[i].write(x_2[i] * cos_2[i] + x_1[i] * sin_2[i]);
                            }
                        }
                    }
                },
            )
        })
    };
    Some([tensor_f32(out, shape)])
}
