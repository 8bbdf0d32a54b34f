//! The machinery the fused ops' native loops on Flex (Burn's CPU backend) share: what
//! `Parallel<Flex>` runs in f32 on rayon's threads, where the reference in Burn tensor ops would
//! compute the same values one Flex op at a time (most of them on one thread, each writing a
//! new tensor). The loops themselves live with their ops (`attention/flex.rs`,
//! `bias_gelu/flex.rs`, `layer_norm/flex.rs`, `matmul/flex.rs`, `rope/flex.rs`,
//! `swiglu/flex.rs`, [`super::add`]); here are the f32 views and the single-threaded products
//! on them (Flex's own `gemm` kernels), tensors written in parallel without zeroing, a scaling
//! in a tensor's own memory ([`scale_in_place`]), and the exponential [`exp`]: arithmetic the compiler vectorises, in loops compiled for the CPU's
//! widest SIMD (AVX-512 or AVX2, chosen at run time by [`vectorised`]).
//!
//! Inputs of another type (f16, bf16) run the reference.

use std::mem::MaybeUninit;

use burn::tensor::{DType, Shape, TensorData};
use burn_flex::FlexTensor;
use rayon::prelude::*;

/// `tensor`'s f32 elements with every stride non-negative: the tensor as it is when it already
/// lies so, or a contiguous copy.
pub(crate) fn readable_f32(tensor: FlexTensor) -> Option<FlexTensor> {
    if tensor.dtype() != DType::F32 {
        return None;
    }
    Some(match tensor.layout().has_positive_strides() {
        true => tensor,
        false => tensor.to_contiguous(),
    })
}

/// A strided f32 matrix in a slice: element `(r, c)` at `offset + r·row_stride + c·col_stride`.
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    pub(crate) data: &'a [f32],
    pub(crate) offset: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_stride: usize,
    pub(crate) col_stride: usize,
}

impl<'a> View<'a> {
    /// `rows × cols` row-major at the start of `data`.
    pub(crate) fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self {
            data,
            offset: 0,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose (no copy).
    pub(crate) fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// Element `(r, c)`.
    pub(crate) fn at(&self, r: usize, c: usize) -> f32 {
        self.data[self.offset + r * self.row_stride + c * self.col_stride]
    }

    /// Every element lies inside `data`.
    pub(crate) fn in_bounds(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || self.offset + (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride
                < self.data.len()
    }
}

/// `dst = scale·lhs·rhs`, or `dst += scale·lhs·rhs` when `accumulate`; `dst` is row-major
/// `[lhs.rows, rhs.cols]` in a slice, its rows `dst_stride` apart. Flex's own matmul kernels
/// (the `gemm` crate, which picks the CPU's widest vectors at run time), on one thread.
///
/// # Panics
/// When the shapes do not chain or a matrix leaves its slice.
pub(crate) fn gemm_into(
    dst: &mut [f32],
    dst_stride: usize,
    lhs: View,
    rhs: View,
    scale: f32,
    accumulate: bool,
) {
    let (m, n, k) = (lhs.rows, rhs.cols, lhs.cols);
    assert_eq!(k, rhs.rows, "gemm_into: {m}×{k} by {}×{n}", rhs.rows);
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * dst_stride + n <= dst.len() && n <= dst_stride);
    assert!(lhs.in_bounds() && rhs.in_bounds());
    if k == 0 {
        if !accumulate {
            dst.chunks_mut(dst_stride)
                .take(m)
                .for_each(|row| row[..n].fill(0.0));
        }
        return;
    }
    let stride = |s: usize| s as isize;
    // SAFETY: the three matrices lie inside their slices (asserted above), `dst` is borrowed
    // mutably and the inputs shared, so nothing the call writes is read through another path.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            stride(dst_stride),
            accumulate,
            lhs.data.as_ptr().add(lhs.offset),
            stride(lhs.col_stride),
            stride(lhs.row_stride),
            rhs.data.as_ptr().add(rhs.offset),
            stride(rhs.col_stride),
            stride(rhs.row_stride),
            1.0,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// `values` as an f32 tensor of `shape`.
pub(crate) fn tensor_f32(values: Vec<f32>, shape: Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// `len` new f32 written in parallel by `fill(index, part)`, one call per part of `chunk`
/// elements (the last may be shorter), and what each call returned, in order. The memory is
/// not zeroed first: `vec![0.0; len]` would cost one more pass over it, on the calling thread.
///
/// # Safety
/// `fill` must write every element of its part (`MaybeUninit::write`) before it returns.
pub(crate) unsafe fn par_written<R: Send>(
    len: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) -> R + Sync,
) -> (Vec<f32>, Vec<R>) {
    let mut values = Vec::with_capacity(len);
    let returned = values.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk.max(1))
        .enumerate()
        .map(|(index, part)| fill(index, part))
        .collect();
    // SAFETY: the capacity is `len`, and `fill` wrote every element below it (the caller's
    // promise); a panic in `fill` leaves the length 0.
    unsafe { values.set_len(len) };
    (values, returned)
}

/// [`par_written`] for two outputs of `len` written together: `fill(index, first, second)`
/// writes part `index` of each (parts of `chunk` elements, the same in both).
///
/// # Safety
/// `fill` must write every element of both its parts (`MaybeUninit::write`) before it returns.
pub(crate) unsafe fn par_written_pair(
    len: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>], &mut [MaybeUninit<f32>]) + Sync,
) -> [Vec<f32>; 2] {
    let (mut first, mut second) = (Vec::with_capacity(len), Vec::with_capacity(len));
    first.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk.max(1))
        .zip(second.spare_capacity_mut()[..len].par_chunks_mut(chunk.max(1)))
        .enumerate()
        .for_each(|(index, (first, second))| fill(index, first, second));
    // SAFETY: both capacities are `len`, and `fill` wrote every element below it (the caller's
    // promise); a panic in `fill` leaves the lengths 0.
    unsafe {
        first.set_len(len);
        second.set_len(len);
    }
    [first, second]
}

/// `e^x` in f32, within 2 ulp, in arithmetic a loop over it vectorises into (the C library's
/// `expf` is one call per element): `x = n·ln 2 + r` with `n` the integer nearest `x·log₂e` and
/// `|r| ≤ ln 2 / 2`; `e^r` by its Taylor polynomial to degree 7 (remainder under 2⁻²⁷ relative);
/// `2ⁿ` written as float bits. `n` is read off the bits of `x·log₂e + 1.5·2²³`, whose rounding
/// is to the nearest integer, so no float-to-integer conversion is needed. Results under e^−87
/// flush to 0 and over e^88 become +∞; NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const ROUNDER: f32 = 12_582_912.0;
    const LN2_HIGH: f32 = 0.693_145_75;
    const LN2_LOW: f32 = 1.428_606_8e-6;
    let (low, high) = (-87.0, 88.0);
    let clamped = if x < low {
        low
    } else if x > high {
        high
    } else {
        x
    };
    let shifted = clamped * std::f32::consts::LOG2_E + ROUNDER;
    let n = shifted - ROUNDER;
    // ln 2 in two parts (Cody and Waite), so `n·ln 2` loses no bits of `r`.
    let r = (clamped - n * LN2_HIGH) - n * LN2_LOW;
    let taylor = [720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0].map(|factorial| 1.0 / factorial);
    let e_r = taylor.into_iter().fold(1.0 / 5040.0, |p, c| p * r + c);
    let exponent_bits = shifted.to_bits().wrapping_sub(ROUNDER.to_bits());
    let two_n = f32::from_bits(exponent_bits.wrapping_add(127) << 23);
    if x < low {
        0.0
    } else if x > high {
        f32::INFINITY
    } else {
        e_r * two_n
    }
}

/// Runs `f` compiled for the widest SIMD the CPU has (AVX-512, else AVX2 with FMA, on x86-64;
/// `pulp`'s run-time dispatch), so that loops inlined into it vectorise to that width.
#[inline(always)]
pub(crate) fn vectorised<R>(f: impl FnOnce() -> R) -> R {
    pulp::Arch::new().dispatch(f)
}

/// `v ← e^(v − shift)` for every element.
pub(crate) fn exp_shifted(values: &mut [f32], shift: f32) {
    vectorised(
        #[inline(always)]
        || values.iter_mut().for_each(|v| *v = exp(*v - shift)),
    );
}

/// Rows of `columns` elements per parallel task of the elementwise ops: about 64 Ki elements.
pub(crate) fn rows_per_task(columns: usize) -> usize {
    (65_536 / columns.max(1)).max(1)
}

/// `t` with its elements contiguous (itself when they are).
pub(crate) fn contiguous(t: FlexTensor) -> FlexTensor {
    match t.layout().contiguous_offsets() {
        Some(_) => t,
        None => t.to_contiguous(),
    }
}

/// The elements of contiguous f32 `t`, writable (Flex copies the memory first when another
/// tensor shares it).
pub(crate) fn elements_mut(t: &mut FlexTensor) -> &mut [f32] {
    let (start, end) = t
        .layout()
        .contiguous_offsets()
        .expect("made contiguous before");
    &mut t.storage_mut::<f32>()[start..end]
}

/// Whether `t`'s elements can be written where they lie without a copy: no other tensor shares
/// its memory, and they are contiguous from its start.
pub(crate) fn owns_its_elements(t: &FlexTensor) -> bool {
    let elements = t.layout().num_elements();
    t.is_unique() && t.layout().contiguous_offsets() == Some((0, elements))
}

/// Elements per task of [`scale_in_place`].
const SCALE_TASK: usize = 1 << 16;

/// `tensor · factor` for a contiguous f32 `tensor` that no other tensor shares and a
/// one-element f32 `factor`, multiplied in `tensor`'s own memory on rayon's threads (Flex
/// multiplies by a broadcast factor into a new tensor); the inputs back otherwise.
#[allow(clippy::result_large_err)] // the inputs handed back, moved once a call
pub fn scale_in_place(
    [tensor, factor]: [FlexTensor; 2],
) -> Result<[FlexTensor; 1], [FlexTensor; 2]> {
    let taken = tensor.dtype() == DType::F32
        && factor.dtype() == DType::F32
        && factor.layout().num_elements() == 1
        && owns_its_elements(&tensor);
    let value = match factor.as_slice::<f32>() {
        Some(&[value]) if taken => value,
        _ => return Err([tensor, factor]),
    };
    let mut tensor = tensor;
    elements_mut(&mut tensor)
        .par_chunks_mut(SCALE_TASK)
        .for_each(|part| vectorised(|| part.iter_mut().for_each(|x| *x *= value)));
    Ok([tensor])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `exp` within 2 ulp of e^x over its whole range (about 240,000 points, both ends
    /// included), through `exp_shifted`'s vectorised loop as the kernels call it; and its ends:
    /// 0 below, +∞ above, NaN through.
    #[test]
    fn exp_is_within_two_ulp() {
        let points: Vec<f32> = (0..=240_000)
            .map(|i| -87.0 + 175.0 * i as f32 / 240_000.0)
            .collect();
        let mut values = points.clone();
        exp_shifted(&mut values, 0.0);
        for (x, got) in points.iter().zip(values) {
            let exact = f64::from(*x).exp();
            let ulps = (f64::from(got) - exact).abs() / (exact * f64::from(f32::EPSILON) / 2.0);
            assert!(ulps <= 2.0, "e^{x}: {got} for {exact} ({ulps:.2} ulp)");
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-88.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    /// `gemm_into` against the sum of products, on plain and transposed views, shapes with ones
    /// among them, writing and accumulating.
    #[test]
    fn gemm_into_matches_the_sum_of_products() {
        let values: Vec<f32> = (0..4096).map(|i| ((i * 37) % 23) as f32 - 11.0).collect();
        for (m, n, k) in [(1, 1, 1), (1, 32, 1), (1, 1, 32), (3, 5, 7), (32, 17, 64)] {
            for transposed in [false, true] {
                let lhs = match transposed {
                    false => View::row_major(&values, m, k),
                    true => View::row_major(&values, k, m).t(),
                };
                let rhs = View {
                    offset: 3,
                    ..View::row_major(&values, n, k).t()
                };
                for (accumulate, pad) in [(false, 0), (false, 2), (true, 0), (true, 2)] {
                    let stride = n + pad;
                    let mut dst = vec![1.0f32; m * stride];
                    gemm_into(&mut dst, stride, lhs, rhs, 0.5, accumulate);
                    for r in 0..m {
                        for c in 0..n {
                            let sum: f32 = (0..k).map(|i| lhs.at(r, i) * rhs.at(i, c)).sum();
                            let expected = 0.5 * sum + if accumulate { 1.0 } else { 0.0 };
                            let got = dst[r * stride + c];
                            assert_eq!(got, expected, "{m}×{n}×{k} t {transposed} at ({r}, {c})");
                        }
                        if pad > 0 {
                            assert_eq!(dst[r * stride + n], 1.0, "past the row");
                        }
                    }
                }
            }
        }
    }
}
