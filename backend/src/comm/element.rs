//! Element types that travel through collectives, and how they are reduced.
//!
//! Every reduction is a left fold in group-rank order, `((x₀ ∘ x₁) ∘ x₂) ∘ …`, computed in the
//! element's accumulation type ([`CommElem::Acc`]): f32 for f16/bf16/f32, f64 for f64, and the
//! integer itself (wrapping) for i32/i64. One rank computes each output element and sends it to
//! the others, so every rank holds bitwise the same result whatever the timing.

use burn::tensor::{DType, bf16, f16};

/// How values from the ranks of a group are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Σ xᵢ, summed in group-rank order.
    Sum,
    /// (Σ xᵢ) / n, the sum divided once by the group size (integers truncate toward zero).
    Mean,
    /// maxᵢ xᵢ; NaN if any xᵢ is NaN.
    Max,
    /// minᵢ xᵢ; NaN if any xᵢ is NaN.
    Min,
}

impl ReduceOp {
    pub(crate) fn code(self) -> u64 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Mean => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
        }
    }
}

/// The element types a message can carry, with a stable one-byte code for the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum WireDType {
    /// Raw bytes (control messages).
    U8 = 0,
    F32 = 1,
    F64 = 2,
    F16 = 3,
    BF16 = 4,
    I32 = 5,
    I64 = 6,
}

impl WireDType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            WireDType::U8 => 1,
            WireDType::F16 | WireDType::BF16 => 2,
            WireDType::F32 | WireDType::I32 => 4,
            WireDType::F64 | WireDType::I64 => 8,
        }
    }

    /// The Burn dtype of this wire type.
    pub fn to_burn(self) -> DType {
        match self {
            WireDType::U8 => DType::U8,
            WireDType::F32 => DType::F32,
            WireDType::F64 => DType::F64,
            WireDType::F16 => DType::F16,
            WireDType::BF16 => DType::BF16,
            WireDType::I32 => DType::I32,
            WireDType::I64 => DType::I64,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        [
            WireDType::U8,
            WireDType::F32,
            WireDType::F64,
            WireDType::F16,
            WireDType::BF16,
            WireDType::I32,
            WireDType::I64,
        ]
        .into_iter()
        .find(|d| *d as u8 == code)
    }

    /// The wire type of a Burn dtype, if collectives support it.
    pub fn from_burn(dtype: DType) -> Option<Self> {
        Some(match dtype {
            DType::F32 | DType::Flex32 => WireDType::F32,
            DType::F64 => WireDType::F64,
            DType::F16 => WireDType::F16,
            DType::BF16 => WireDType::BF16,
            DType::I32 => WireDType::I32,
            DType::I64 => WireDType::I64,
            DType::U8 => WireDType::U8,
            _ => return None,
        })
    }
}

/// Calls `$body` with the type alias `$E` bound to the Rust element type of a [`WireDType`].
macro_rules! with_elem_type {
    ($dtype:expr, $E:ident => $body:expr) => {
        match $dtype {
            $crate::comm::WireDType::U8 => {
                type $E = u8;
                $body
            }
            $crate::comm::WireDType::F32 => {
                type $E = f32;
                $body
            }
            $crate::comm::WireDType::F64 => {
                type $E = f64;
                $body
            }
            $crate::comm::WireDType::F16 => {
                type $E = ::burn::tensor::f16;
                $body
            }
            $crate::comm::WireDType::BF16 => {
                type $E = ::burn::tensor::bf16;
                $body
            }
            $crate::comm::WireDType::I32 => {
                type $E = i32;
                $body
            }
            $crate::comm::WireDType::I64 => {
                type $E = i64;
                $body
            }
        }
    };
}
pub(crate) use with_elem_type;

/// The accumulation type of a reduction: the arithmetic a fold is done in.
pub trait Accumulator: Copy + Default + Send + Sync + 'static {
    fn combine(self, other: Self, op: ReduceOp) -> Self;
    /// Divides by the group size (for [`ReduceOp::Mean`]).
    fn div_count(self, n: usize) -> Self;
}

macro_rules! float_accumulator {
    ($t:ty) => {
        impl Accumulator for $t {
            #[inline(always)]
            fn combine(self, other: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Mean => self + other,
                    // NaN propagates, as in torch.max: `f32::max` would drop it.
                    ReduceOp::Max if self.is_nan() || other.is_nan() => <$t>::NAN,
                    ReduceOp::Min if self.is_nan() || other.is_nan() => <$t>::NAN,
                    ReduceOp::Max => self.max(other),
                    ReduceOp::Min => self.min(other),
                }
            }
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
float_accumulator!(f32);
float_accumulator!(f64);

macro_rules! int_accumulator {
    ($t:ty) => {
        impl Accumulator for $t {
            #[inline(always)]
            fn combine(self, other: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Mean => self.wrapping_add(other),
                    ReduceOp::Max => self.max(other),
                    ReduceOp::Min => self.min(other),
                }
            }
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
int_accumulator!(i32);
int_accumulator!(i64);
int_accumulator!(u8);

/// An element type collectives can move and reduce.
pub trait CommElem: bytemuck::Pod + burn::tensor::Element + Send + Sync + 'static {
    /// Its code on the wire.
    const DTYPE: WireDType;
    /// The type reductions accumulate in.
    type Acc: Accumulator;
    fn to_acc(self) -> Self::Acc;
    fn from_acc(acc: Self::Acc) -> Self;
}

macro_rules! comm_elem {
    ($t:ty, $code:ident, $acc:ty, |$x:ident| $to:expr, |$a:ident| $from:expr) => {
        impl CommElem for $t {
            const DTYPE: WireDType = WireDType::$code;
            type Acc = $acc;
            #[inline(always)]
            fn to_acc(self) -> $acc {
                let $x = self;
                $to
            }
            #[inline(always)]
            fn from_acc($a: $acc) -> Self {
                $from
            }
        }
    };
}
comm_elem!(u8, U8, u8, |x| x, |a| a);
comm_elem!(f32, F32, f32, |x| x, |a| a);
comm_elem!(f64, F64, f64, |x| x, |a| a);
comm_elem!(f16, F16, f32, |x| x.to_f32(), |a| f16::from_f32(a));
comm_elem!(bf16, BF16, f32, |x| x.to_f32(), |a| bf16::from_f32(a));
comm_elem!(i32, I32, i32, |x| x, |a| a);
comm_elem!(i64, I64, i64, |x| x, |a| a);

/// Elements folded per block: small enough for the accumulators to stay in L1.
const BLOCK: usize = 1024;

/// Adds one input block to the accumulators: the first input (`first`) initialises them.
#[inline(always)]
fn accumulate<E: CommElem>(acc: &mut [E::Acc], first: bool, input: &[E], op: ReduceOp) {
    if first {
        for (a, x) in acc.iter_mut().zip(input) {
            *a = x.to_acc();
        }
    } else {
        for (a, x) in acc.iter_mut().zip(input) {
            *a = a.combine(x.to_acc(), op);
        }
    }
}

/// Turns finished accumulators into output elements (dividing by n for a mean).
#[inline(always)]
fn finish<E: CommElem>(acc: &mut [E::Acc], n: usize, op: ReduceOp, out: &mut [E]) {
    if op == ReduceOp::Mean {
        for a in acc.iter_mut() {
            *a = a.div_count(n);
        }
    }
    for (o, a) in out.iter_mut().zip(acc.iter()) {
        *o = E::from_acc(*a);
    }
}

/// Folds the inputs, in order, into `io`, which is itself input number `io_index`.
///
/// `others` holds the remaining inputs in order (input `io_index` is missing from it). All slices
/// have `io.len()` elements. Result: `io[i] = x₀[i] ∘ x₁[i] ∘ … ∘ xₙ₋₁[i]`, folded left to right in
/// the accumulation type, then divided by n for [`ReduceOp::Mean`].
pub(crate) fn fold_in_place<E: CommElem>(
    io: &mut [E],
    io_index: usize,
    others: &[&[E]],
    op: ReduceOp,
) {
    let n = others.len() + 1;
    let mut acc = [E::Acc::default(); BLOCK];
    for start in (0..io.len()).step_by(BLOCK) {
        let block = start..(start + BLOCK).min(io.len());
        let acc = &mut acc[..block.len()];
        for k in 0..n {
            let input: &[E] = match k.cmp(&io_index) {
                std::cmp::Ordering::Less => &others[k][block.clone()],
                std::cmp::Ordering::Equal => &io[block.clone()],
                std::cmp::Ordering::Greater => &others[k - 1][block.clone()],
            };
            accumulate(acc, k == 0, input, op);
        }
        finish(acc, n, op, &mut io[block]);
    }
}

/// Folds `regions` (n inputs of `len` elements each, in rank order) and writes the result back
/// into every one of them: the all-reduce of ranks that share memory. Each block is read from all
/// regions and then written to all of them while its cache lines are still held, so the result
/// costs no extra read from memory.
///
/// # Safety
/// Every region is valid for `len` elements and nobody else reads or writes any of them during
/// the call (regions may not overlap each other).
pub(crate) unsafe fn fold_regions<E: CommElem>(regions: &[*mut E], len: usize, op: ReduceOp) {
    let mut acc = [E::Acc::default(); BLOCK];
    let mut block = [E::zeroed(); BLOCK];
    for start in (0..len).step_by(BLOCK) {
        let width = BLOCK.min(len - start);
        let acc = &mut acc[..width];
        for (k, region) in regions.iter().enumerate() {
            // SAFETY: in bounds, and no mutable reference to this memory exists (caller's contract).
            let input = unsafe { std::slice::from_raw_parts(region.add(start), width) };
            accumulate(acc, k == 0, input, op);
        }
        let block = &mut block[..width];
        finish(acc, regions.len(), op, block);
        for region in regions {
            // SAFETY: as above; the shared slice of this region was dropped before.
            unsafe { std::slice::from_raw_parts_mut(region.add(start), width) }
                .copy_from_slice(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fold_is_left_to_right_in_rank_order() {
        // 1e8 + 1 - 1e8 in f32: left fold gives 0 (1 is lost), any other order can give 1.
        let mut io = vec![1.0f32];
        fold_in_place(&mut io, 1, &[&[1e8], &[-1e8]], ReduceOp::Sum);
        assert_eq!(io, vec![0.0]);
        // Same values, 1 last: (1e8 - 1e8) + 1 = 1.
        let mut io = vec![1.0f32];
        fold_in_place(&mut io, 2, &[&[1e8], &[-1e8]], ReduceOp::Sum);
        assert_eq!(io, vec![1.0]);
    }

    #[test]
    fn half_precision_accumulates_in_f32() {
        // 2048 + 1 is not representable in f16, but 2048 + 1 + 1 = 2050 is; f16 accumulation gives 2048.
        let one = f16::from_f32(1.0);
        let mut io = vec![f16::from_f32(2048.0)];
        fold_in_place(&mut io, 0, &[&[one], &[one]], ReduceOp::Sum);
        assert_eq!(io[0].to_f32(), 2050.0);
    }

    #[test]
    fn max_min_mean_and_nan() {
        let mut io = vec![1.0f32, f32::NAN, 3.0];
        fold_in_place(&mut io, 0, &[&[2.0, 0.0, -1.0]], ReduceOp::Max);
        assert_eq!(io[0], 2.0);
        assert!(io[1].is_nan());
        assert_eq!(io[2], 3.0);
        let mut io = vec![7i64, -3];
        fold_in_place(&mut io, 1, &[&[2, 9]], ReduceOp::Min);
        assert_eq!(io, vec![2, -3]);
        let mut io = vec![3i32, 5];
        fold_in_place(&mut io, 0, &[&[4, 5]], ReduceOp::Mean);
        assert_eq!(io, vec![3, 5]);
    }

    #[test]
    fn long_inputs_cross_block_boundaries() {
        let a: Vec<i64> = (0..3000).collect();
        let b: Vec<i64> = (0..3000).map(|x| 10 * x).collect();
        let mut io = vec![1i64; 3000];
        fold_in_place(&mut io, 2, &[&a, &b], ReduceOp::Sum);
        assert!(io.iter().enumerate().all(|(i, v)| *v == 11 * i as i64 + 1));
    }

    #[test]
    fn fold_regions_writes_the_result_into_every_region() {
        let mut a: Vec<f32> = (0..2500).map(|i| i as f32).collect();
        let mut b: Vec<f32> = (0..2500).map(|i| 2.0 * i as f32).collect();
        let mut c: Vec<f32> = vec![0.5; 2500];
        let regions = [a.as_mut_ptr(), b.as_mut_ptr(), c.as_mut_ptr()];
        // SAFETY: three distinct vectors of 2500 elements, used by nobody else meanwhile.
        unsafe { fold_regions(&regions, 2500, ReduceOp::Sum) };
        for v in [&a, &b, &c] {
            assert!(
                v.iter()
                    .enumerate()
                    .all(|(i, x)| *x == 3.0 * i as f32 + 0.5)
            );
        }
    }

    #[test]
    fn wire_codes_round_trip() {
        for code in 0..=6u8 {
            let d = WireDType::from_code(code).expect("valid code");
            assert_eq!(d as u8, code);
        }
        assert_eq!(WireDType::from_code(7), None);
    }
}
