//! Flex's add on rayon's threads, where Flex's own is slow (tensors of one shape on one
//! thread; an operand repeated along leading dims, walked element by element): the decorator
//! routes `float_add` on Flex here ([`add`]), with Flex's sums bit for bit.

use burn::tensor::{DType, Shape};
use burn_flex::FlexTensor;

use super::flex::{par_written, tensor_f32, vectorised};

/// Elements per task of [`add`], and the fewest it takes for tensors of one shape: below two
/// tasks Flex's own add (in place when it can, on one thread) is as fast.
const ADD_TASK: usize = 1 << 16;

/// The shortest repeated operand [`add`] takes; Flex adds shorter ones (a scalar, a few
/// columns) well enough.
const MIN_PERIOD: usize = 64;

/// Whether adding `small` to `big` (of one rank) repeats `small` whole: `small` is `big`'s
/// shape with leading dims of 1 (none: the same shape).
fn repeats_along_leading(small: &Shape, big: &Shape) -> bool {
    let (small, big) = (small.as_slice(), big.as_slice());
    let first = small.iter().position(|&d| d != 1).unwrap_or(small.len());
    small.len() == big.len() && small[first..] == big[first..]
}

/// `lhs + rhs` for contiguous f32 tensors, on rayon's threads, where Flex's add is slow:
/// - tensors of one shape with at least `2·ADD_TASK` elements, on more than one thread (Flex
///   adds on one; on one thread its add, in place when it can, was as fast: tiny GPT 140
///   against 144 ms a step);
/// - one operand repeated along leading dims of 1 (a position embedding `[1, T, C]` on
///   `[B, T, C]`, a bias `[1, n]` on `[rows, n]`) of at least `MIN_PERIOD` elements: Flex walks
///   such a broadcast element by element.
///
/// `None` for other inputs. The sums are Flex's, bit for bit (one rounding each, and
/// `a + b = b + a`).
pub fn add([lhs, rhs]: [FlexTensor; 2]) -> Option<[FlexTensor; 1]> {
    let (lhs_shape, rhs_shape) = (lhs.layout().shape(), rhs.layout().shape());
    let (whole, repeated) = match repeats_along_leading(rhs_shape, lhs_shape) {
        true => (&lhs, &rhs),
        false => (&rhs, &lhs),
    };
    let (shape, period) = (
        whole.layout().shape().clone(),
        repeated.layout().num_elements(),
    );
    let taken = lhs.dtype() == DType::F32
        && rhs.dtype() == DType::F32
        && repeats_along_leading(repeated.layout().shape(), &shape)
        && match period == shape.num_elements() {
            true => period >= 2 * ADD_TASK && rayon::current_num_threads() > 1,
            false => period >= MIN_PERIOD,
        };
    if !taken {
        return None;
    }
    let (a, b) = (whole.as_slice::<f32>()?, repeated.as_slice::<f32>()?);
    // SAFETY: a part's elements are written in runs, each zipped with the same range of `a`
    // and a range of `b` of its length; the runs cover the part.
    let (sum, _) = unsafe {
        par_written(a.len(), ADD_TASK, |index, part| {
            let start = index * ADD_TASK;
            let mut done = 0;
            while done < part.len() {
                let offset = (start + done) % period;
                let run = (period - offset).min(part.len() - done);
                let a = &a[start + done..][..run];
                let b = &b[offset..][..run];
                vectorised(
                    #[inline(always)]
                    || {
                        for ((out, a), b) in part[done..done + run].iter_mut().zip(a).zip(b) {
                            out.write(a + b);
                        }
                    },
                );
                done += run;
            }
        })
    };
    Some([tensor_f32(sum, shape)])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `add` sums bit for bit like Flex's own add over a tensor of several tasks (the last one
    /// short), on two threads, and with an operand repeated along a leading dim (either side,
    /// runs crossing the tasks' bounds), on one; and declines what it does not take: small
    /// tensors, short repeats, other shapes, strided views, same shapes on one thread.
    #[test]
    fn add_matches_flexs_add_and_declines_the_rest() {
        use burn::backend::Flex;
        use burn::tensor::{Distribution, Tensor};

        let device = Default::default();
        let len = 2 * ADD_TASK + 1000;
        let draw = |len: usize| {
            Tensor::<Flex, 1>::random([len], Distribution::Normal(0.0, 1.0), &device)
                .into_primitive()
                .tensor()
        };
        let (a, b) = (draw(len), draw(len));
        let pool = |threads| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
        };
        let inputs = || [a.clone(), b.clone()];
        assert!(pool(1).install(|| add(inputs())).is_none(), "one thread");
        let [sum] = pool(2).install(|| add(inputs())).expect("taken");
        let flex_sum = Tensor::<Flex, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(a))
            + Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(b));
        let bits = |t: FlexTensor| -> Vec<u32> {
            t.into_data()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(bits(sum), bits(flex_sum.into_primitive().tensor()));

        // A repeated operand, either side, on one thread too.
        let period = [1, 128, 192];
        let block = draw(128 * 192).reshape(Shape::new(period));
        let batch = draw(5 * 128 * 192).reshape(Shape::new([5, 128, 192]));
        let flex = |t: FlexTensor| {
            Tensor::<Flex, 3>::from_primitive(burn::tensor::TensorPrimitive::Float(t))
        };
        let expected = bits(
            (flex(batch.clone()) + flex(block.clone()))
                .into_primitive()
                .tensor(),
        );
        for inputs in [[batch.clone(), block.clone()], [block, batch]] {
            let [sum] = pool(1).install(|| add(inputs)).expect("repeated, taken");
            assert_eq!(sum.layout().shape(), &Shape::new([5, 128, 192]));
            assert_eq!(bits(sum), expected, "a repeated operand");
        }

        let declined = |inputs| pool(2).install(|| add(inputs)).is_none();
        let scalar = || draw(1).reshape(Shape::new([1, 1]));
        assert!(
            declined([draw(len).reshape(Shape::new([len, 1])), scalar()]),
            "a scalar"
        );
        assert!(declined([draw(1000), draw(1000)]), "a small tensor");
        assert!(declined([draw(len), draw(len + 1)]), "shapes differ");
        let square = || draw(4 * ADD_TASK).reshape(Shape::new([512, 512]));
        assert!(
            declined([square().transpose(0, 1), square()]),
            "a transposed view"
        );
    }
}
