//! Flex's f32 matmul without its allocation overhead: what `Parallel<Flex>` runs for a float
//! matmul when the matmul precision policy is off; and a product added into an existing
//! matrix's memory ([`accumulate`], the blocked cross-entropy's weight gradient).
//!
//! Flex allocates every matmul's output zeroed as bytes and then, to align the bytes, copies it
//! into a second allocation (`FlexTensor::empty`): a memset and a memcpy of the output per
//! matmul, about a tenth of a tiny GPT's training step on one thread. This computes the same
//! products with the same `gemm` calls (the same strides, blocking and threading, so the same
//! values bit for bit) into an output the products write once.
//!
//! For `lhs: […, m, k]` and `rhs: […, k, n]` the batch dimensions broadcast as in NumPy (a
//! dimension of 1, or a missing leading one, repeats), and the product of batch `i` is the `m × n`
//! matrix `lhs_i · rhs_i`, read where the inputs lie (any strides, no copy).

use burn::tensor::{DType, Shape, TensorData};
use burn_flex::FlexTensor;
use rayon::prelude::*;

use crate::kernels::flex::{elements_mut, owns_its_elements};

/// Work (`m·n·k`) from which one matrix's product is split over the threads, inside `gemm`.
const SPLIT_MATRIX_WORK: usize = 192 * 192 * 192;
/// Total work from which a batch of at least two matrices runs its matrices in parallel, one
/// thread each (preferred over splitting each matrix from four matrices on).
const SPLIT_BATCH_WORK: usize = 128 * 128 * 128;

/// How a batch of products is spread over the threads (Flex's choice, kept so that the values
/// are Flex's: `gemm`'s own threading is part of what it computes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Threads {
    /// One product after another, each split over the threads inside `gemm`.
    InsideEachMatrix,
    /// The products in parallel, each on one thread.
    AcrossMatrices,
    /// Everything on the calling thread.
    One,
}

impl Threads {
    fn for_batch(matrices: usize, work_per_matrix: usize) -> Self {
        let total = matrices.saturating_mul(work_per_matrix);
        let batch_preferred = matrices >= 4 && total >= SPLIT_BATCH_WORK;
        if work_per_matrix >= SPLIT_MATRIX_WORK && !batch_preferred {
            Self::InsideEachMatrix
        } else if total >= SPLIT_BATCH_WORK && matrices > 1 {
            Self::AcrossMatrices
        } else {
            Self::One
        }
    }
}

/// One input's matrices: where matrix `i` of the broadcast batch starts, and its row and
/// column strides (elements).
struct Operand<'a> {
    data: &'a [f32],
    start: isize,
    /// Per broadcast batch dimension, the step of the input's offset (0 where it repeats).
    batch_strides: Vec<isize>,
    row_stride: isize,
    col_stride: isize,
}

impl<'a> Operand<'a> {
    fn of(tensor: &'a FlexTensor, batch: &[usize]) -> Self {
        let layout = tensor.layout();
        let (shape, strides) = (layout.shape(), layout.strides());
        let rank = shape.num_dims();
        let missing = batch.len() + 2 - rank;
        let batch_strides = (0..batch.len())
            .map(|dim| match dim.checked_sub(missing) {
                Some(own) if shape[own] > 1 => strides[own],
                _ => 0,
            })
            .collect();
        Self {
            data: tensor.storage::<f32>(),
            start: layout.start_offset() as isize,
            batch_strides,
            row_stride: strides[rank - 2],
            col_stride: strides[rank - 1],
        }
    }

    /// Where matrix `index` (row-major over the broadcast batch `batch`) starts.
    fn matrix_start(&self, index: usize, batch: &[usize]) -> isize {
        let mut rest = index;
        let mut offset = self.start;
        for (&size, &stride) in batch.iter().zip(&self.batch_strides).rev() {
            offset += (rest % size) as isize * stride;
            rest /= size;
        }
        offset
    }
}

/// The batch dimensions `lhs`'s and `rhs`'s broadcast to, or `None` where two differ and
/// neither is 1.
fn broadcast(lhs: &[usize], rhs: &[usize]) -> Option<Vec<usize>> {
    let rank = lhs.len().max(rhs.len());
    let padded = |dims: &[usize], dim: usize| match dim.checked_sub(rank - dims.len()) {
        Some(own) => dims[own],
        None => 1,
    };
    (0..rank)
        .map(|dim| match (padded(lhs, dim), padded(rhs, dim)) {
            (l, r) if l == r || r == 1 => Some(l),
            (1, r) => Some(r),
            _ => None,
        })
        .collect()
}

/// `lhs · rhs` for f32 `[…, m, k]` and `[…, k, n]` (batch dimensions broadcast; see the module
/// doc), or `None` for inputs it does not take: not both f32, a rank below 2, inner dimensions
/// that differ, batch dimensions that do not broadcast (Flex then reports them).
pub fn matmul([lhs, rhs]: [FlexTensor; 2]) -> Option<[FlexTensor; 1]> {
    if lhs.dtype() != DType::F32 || rhs.dtype() != DType::F32 {
        return None;
    }
    let (lhs_shape, rhs_shape) = (lhs.layout().shape(), rhs.layout().shape());
    let (lhs_rank, rhs_rank) = (lhs_shape.num_dims(), rhs_shape.num_dims());
    if lhs_rank < 2 || rhs_rank < 2 || lhs_shape[lhs_rank - 1] != rhs_shape[rhs_rank - 2] {
        return None;
    }
    let (m, k, n) = (
        lhs_shape[lhs_rank - 2],
        lhs_shape[lhs_rank - 1],
        rhs_shape[rhs_rank - 1],
    );
    let batch = broadcast(&lhs_shape[..lhs_rank - 2], &rhs_shape[..rhs_rank - 2])?;
    let matrices: usize = batch.iter().product();
    let mut dims = batch.clone();
    dims.extend([m, n]);
    let shape = Shape::from(dims);
    if m == 0 || n == 0 || k == 0 || matrices == 0 {
        return Some([zeros(shape)]);
    }
    let (lhs, rhs) = (Operand::of(&lhs, &batch), Operand::of(&rhs, &batch));
    let threads = Threads::for_batch(matrices, m.saturating_mul(n).saturating_mul(k));
    let product = |index: usize, out: &mut [std::mem::MaybeUninit<f32>]| {
        let parallelism = match threads {
            Threads::InsideEachMatrix => gemm::Parallelism::Rayon(0),
            Threads::AcrossMatrices | Threads::One => gemm::Parallelism::None,
        };
        let (lhs_start, rhs_start) = (
            lhs.matrix_start(index, &batch),
            rhs.matrix_start(index, &batch),
        );
        // SAFETY: `out` holds the `m × n` row-major product, which `gemm` writes whole (the
        // destination is not read: `read_dst` is false); the inputs' matrices lie inside their
        // tensors' storage at the layouts' offsets and strides, which is what `Operand` reads.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                out.as_mut_ptr().cast::<f32>(),
                1,
                n as isize,
                false,
                lhs.data.as_ptr().offset(lhs_start),
                lhs.col_stride,
                lhs.row_stride,
                rhs.data.as_ptr().offset(rhs_start),
                rhs.col_stride,
                rhs.row_stride,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
    };
    let mut values = Vec::<f32>::with_capacity(shape.num_elements());
    let out = &mut values.spare_capacity_mut()[..shape.num_elements()];
    match threads {
        Threads::AcrossMatrices => out
            .par_chunks_mut(m * n)
            .enumerate()
            .for_each(|(index, out)| product(index, out)),
        Threads::InsideEachMatrix | Threads::One => out
            .chunks_mut(m * n)
            .enumerate()
            .for_each(|(index, out)| product(index, out)),
    }
    // SAFETY: every matrix of the output was written above.
    unsafe { values.set_len(shape.num_elements()) };
    Some([FlexTensor::from_data(TensorData::new(values, shape))])
}

/// `acc + lhs · rhs` for f32 matrices `acc: [m, n]`, `lhs: [m, k]` and `rhs: [k, n]` (any
/// strides), summed into `acc`'s own memory by one `gemm` call that reads it (`acc ← acc +
/// lhs·rhs`): no output allocated and no second pass to add, where `acc + lhs.matmul(rhs)`
/// allocates the product and then the sum. Hands the inputs back when `acc` shares its memory
/// with another tensor or is not contiguous from its start, or the inputs are not f32
/// matrices of agreeing shapes.
#[allow(clippy::result_large_err)] // the inputs handed back, moved once a call
pub fn accumulate([acc, lhs, rhs]: [FlexTensor; 3]) -> Result<[FlexTensor; 1], [FlexTensor; 3]> {
    let dims = |t: &FlexTensor| t.layout().shape().as_slice().to_vec();
    let (acc_dims, lhs_dims, rhs_dims) = (dims(&acc), dims(&lhs), dims(&rhs));
    let taken = [&acc, &lhs, &rhs].iter().all(|t| t.dtype() == DType::F32)
        && [&acc_dims, &lhs_dims, &rhs_dims]
            .iter()
            .all(|d| d.len() == 2)
        && lhs_dims[1] == rhs_dims[0]
        && acc_dims == [lhs_dims[0], rhs_dims[1]]
        && owns_its_elements(&acc);
    if !taken {
        return Err([acc, lhs, rhs]);
    }
    let (m, k, n) = (lhs_dims[0], lhs_dims[1], rhs_dims[1]);
    let mut acc = acc;
    if m > 0 && n > 0 && k > 0 {
        let (lhs, rhs) = (Operand::of(&lhs, &[]), Operand::of(&rhs, &[]));
        let parallelism = match m.saturating_mul(n).saturating_mul(k) >= SPLIT_MATRIX_WORK {
            true => gemm::Parallelism::Rayon(0),
            false => gemm::Parallelism::None,
        };
        let out = elements_mut(&mut acc);
        // SAFETY: `out` is `acc`'s own contiguous `m × n` row-major storage (checked unique and
        // contiguous from offset 0 above), which `gemm` reads and writes in place
        // (`read_dst`); the inputs' matrices lie inside their storage at the layouts' offsets
        // and strides, which is what `Operand` reads.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                true,
                lhs.data.as_ptr().offset(lhs.start),
                lhs.col_stride,
                lhs.row_stride,
                rhs.data.as_ptr().offset(rhs.start),
                rhs.col_stride,
                rhs.row_stride,
                1.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
    }
    Ok([acc])
}

fn zeros(shape: Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(vec![0.0f32; shape.num_elements()], shape))
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::{Distribution, Tensor};

    use super::*;

    type B = Flex;

    fn flex<const D: usize>(tensor: Tensor<B, D>) -> FlexTensor {
        tensor.into_primitive().tensor()
    }

    /// `accumulate` sums into `acc`'s own memory (the output's storage is the input's), within
    /// f32 rounding of `acc + lhs·rhs` (a transposed `rhs`, large enough to split over the
    /// threads), and hands back an `acc` whose memory another tensor shares.
    #[test]
    fn accumulates_in_place() {
        let device = Default::default();
        let draw = |dims: [usize; 2]| Tensor::<B, 2>::random(dims, Distribution::Default, &device);
        let (acc, lhs, rhs) = (
            draw([64, 300]),
            draw([64, 256]),
            draw([300, 256]).transpose(),
        );
        let expected: Vec<f32> = (acc.clone() + lhs.clone().matmul(rhs.clone()))
            .into_data()
            .to_vec()
            .unwrap();
        let shared = [flex(acc.clone()), flex(lhs.clone()), flex(rhs.clone())];
        assert!(
            accumulate(shared).is_err(),
            "an acc shared with `acc` is handed back"
        );
        let own = flex(Tensor::<B, 2>::from_data(acc.to_data(), &device));
        let before = own.as_slice::<f32>().unwrap().as_ptr();
        let [sum] = accumulate([own, flex(lhs), flex(rhs)])
            .map_err(|_| "declined")
            .unwrap();
        let got = sum.as_slice::<f32>().unwrap();
        assert_eq!(got.as_ptr(), before, "summed in place");
        let difference = crate::compare::relative_difference(got, &expected);
        assert!(difference <= 1e-6, "{difference:e}");
    }

    /// Bit for bit Flex's own matmul, on shapes that take each of the three threadings, with
    /// broadcast and missing batch dimensions, transposed and sliced inputs and empty ones.
    #[test]
    fn equals_flex_matmul_bit_for_bit() {
        // Values in [-1, 1) from a linear congruential sequence.
        let mut state = 0x2545_f491_u32;
        let mut draw = |dims: Vec<usize>| {
            let values: Vec<f32> = (0..dims.iter().product::<usize>())
                .map(|_| {
                    state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (state >> 8) as f32 / (1u32 << 23) as f32 - 1.0
                })
                .collect();
            FlexTensor::from_data(TensorData::new(values, Shape::from(dims)))
        };
        let cases: Vec<(Vec<usize>, Vec<usize>, &str)> = vec![
            (vec![3, 5], vec![5, 7], "2-D, one thread"),
            (vec![200, 256], vec![256, 300], "2-D, split inside"),
            (
                vec![16, 128, 128],
                vec![1, 128, 384],
                "broadcast batch, across matrices",
            ),
            (
                vec![16, 128, 128],
                vec![128, 384],
                "missing batch dimension",
            ),
            (
                vec![2, 3, 17, 32],
                vec![2, 1, 32, 9],
                "two batch dimensions",
            ),
            (
                vec![2, 256, 256],
                vec![2, 256, 256],
                "two large matrices, split inside",
            ),
            (vec![4, 0, 8], vec![4, 8, 5], "no rows"),
            (vec![4, 6, 0], vec![4, 0, 5], "nothing to sum"),
        ];
        for (lhs_dims, rhs_dims, what) in cases {
            let (lhs, rhs) = (draw(lhs_dims), draw(rhs_dims));
            let expected = burn_flex::ops::matmul::matmul(lhs.clone(), rhs.clone());
            let [got] = matmul([lhs, rhs]).expect(what);
            assert_eq!(got.layout().shape(), expected.layout().shape(), "{what}");
            let bits = |t: FlexTensor| -> Vec<u32> {
                let values: Vec<f32> = t.into_data().to_vec().unwrap();
                values.into_iter().map(f32::to_bits).collect()
            };
            assert!(bits(got) == bits(expected), "{what}: values differ");
        }
    }

    #[test]
    fn reads_transposed_and_sliced_inputs_in_place() {
        let device = Default::default();
        let lhs = Tensor::<B, 3>::random([2, 40, 24], Distribution::Default, &device)
            .swap_dims(1, 2)
            .narrow(2, 3, 30);
        let rhs = Tensor::<B, 3>::random([2, 30, 11], Distribution::Default, &device).flip([2]);
        let expected = burn_flex::ops::matmul::matmul(flex(lhs.clone()), flex(rhs.clone()));
        let [got] = matmul([flex(lhs), flex(rhs)]).unwrap();
        assert_eq!(got.into_data(), expected.into_data());
    }

    #[test]
    fn declines_what_flex_must_report() {
        let device = Default::default();
        let t = |dims: [usize; 3]| flex(Tensor::<B, 3>::zeros(dims, &device));
        assert!(
            matmul([t([2, 3, 4]), t([3, 4, 5])]).is_none(),
            "batch 2 against 3"
        );
        assert!(
            matmul([t([2, 3, 4]), t([2, 5, 5])]).is_none(),
            "inner 4 against 5"
        );
        let half = flex(Tensor::<B, 3>::zeros([2, 3, 4], &device).cast(DType::F16));
        assert!(matmul([half, t([2, 4, 5])]).is_none(), "f16");
    }
}
