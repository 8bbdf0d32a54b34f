//! Rank-stamped exactness checks of every collective, over any world: the thread tests, the
//! process tests (`wildfire launch … -- wildfire comm-check`) and users checking a new cluster
//! run the same code.
//!
//! Rank r's tensor holds `x_r[i] = g_r + (i mod 3)` (g_r its global rank, i the flat index), so
//! every result is a small integer (or a half, for means) that f16, bf16 and the integer types
//! hold exactly: results are compared with `==`, no tolerance. Checks run on the world and on
//! each half of it, in f32, f16, bf16, i32 and i64, for sizes 0, 1, 7, n+1 (not divisible by
//! the group size n) and 4 MiB, along dimension 0 and, for the dimension-aware ops, dimension 1.
//!
//! Small integers add to the same bits in every order, so they cannot tell a transport that
//! folds in rank order from one that does not. The fold checks therefore also all-reduce (sum
//! and mean) and reduce-scatter seeded non-integer f32 and bf16 values of many magnitudes, and
//! compare the bits with the serial fold `((x₀ + x₁) + x₂) + …` in f32, written out here,
//! then divided by n for a mean and rounded once to the dtype. They run through the host
//! collectives, the path of every host transport (threads, shared memory, tcp); NCCL, which
//! reduces in its own order, is not what they check.

use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, DType, Element, Float, Int, Tensor, TensorData};

use burn::tensor::bf16;

use super::algorithms::HostTensor;
use super::element::{CommElem, ReduceOp};
use super::group::ProcessGroup;
use super::layout::split_ranges;
use crate::host_data::aligned;

/// What a run checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckSummary {
    /// Collective calls whose result was compared element by element.
    pub checks: usize,
    /// Of those, the fold checks: seeded non-integer values compared bit for bit with the
    /// serial fold.
    pub fold_checks: usize,
    /// Checks that could not run exactly, and why (e.g. a mean over a group whose size is not a
    /// power of two has no exact binary result).
    pub skipped: Vec<String>,
}

/// The dtypes checked.
pub const DTYPES: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64];

/// Bytes of the large size checked.
pub const LARGE_BYTES: usize = 4 << 20;

/// Runs every check on `world` and on the half of it this rank belongs to (when the world has
/// an even size of at least 4, as the 8-rank test's two groups of 4). `large` adds the 4 MiB size.
pub fn run<B: Backend>(
    world: &ProcessGroup,
    device: &B::Device,
    large: bool,
) -> Result<CheckSummary, String> {
    let mut groups = vec![world.clone()];
    let n = world.size();
    if n >= 4 && n.is_multiple_of(2) {
        let half: Vec<usize> = if world.rank() < n / 2 {
            (0..n / 2).collect()
        } else {
            (n / 2..n).collect()
        };
        groups.push(world.subgroup(&half).map_err(|e| e.to_string())?);
    }
    let mut summary = CheckSummary::default();
    for group in &groups {
        for dtype in DTYPES {
            let mut sizes = vec![0, 1, 7, group.size() + 1];
            if large {
                sizes.push(LARGE_BYTES / dtype.size());
            }
            for &size in &sizes {
                let mut ctx = Ctx::<B> {
                    group,
                    device,
                    dtype,
                    size,
                    summary: &mut summary,
                };
                if dtype.is_float() {
                    ctx.all_ops::<Float>()?;
                } else {
                    ctx.all_ops::<Int>()?;
                }
            }
        }
        let mut sizes = vec![1, group.size() + 1, FOLD_SIZE];
        if large {
            sizes.push(LARGE_BYTES / 4);
        }
        for size in sizes {
            check_folds::<f32>(group, size, &mut summary)?;
            check_folds::<bf16>(group, size, &mut summary)?;
        }
    }
    Ok(summary)
}

/// A middle size of the fold checks: several of the folds' blocks, and not a multiple of any
/// group size up to 8.
const FOLD_SIZE: usize = 3001;

/// Global rank `g`'s value at flat index `i` in the fold checks: a seeded uniform draw in
/// (−1, 1) times 2^e, e in −12..=12. The 25 binades are more than f32's 24 bits hold beside
/// bf16's 8, so sums of a few values round in f32 too, differently by order.
fn fold_value(g: usize, i: usize) -> f32 {
    // SplitMix64 of (rank, index).
    let mut z = ((g as u64) << 40 ^ i as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let unit = (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
    let exponent = (z & 0x1F) as i32 % 25 - 12;
    unit * 2f32.powi(exponent)
}

/// An element type of the fold checks: built from an f32 draw (rounded once) and back.
trait FoldElem: CommElem + Copy {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    fn bits(self) -> u32;
}

impl FoldElem for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
}

impl FoldElem for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
}

/// Global rank `g`'s input of `size` elements in the fold checks.
fn fold_input<E: FoldElem>(g: usize, size: usize) -> Vec<E> {
    (0..size).map(|i| E::from_f32(fold_value(g, i))).collect()
}

/// The serial fold of `inputs` (in order) at every index: summed left to right in f32, divided
/// by the count for a mean, rounded once to `E`; with `round_each_sum`, every partial sum is
/// rounded to `E` as well (a fold in `E`'s own arithmetic, which the transports must not do).
fn serial_fold<E: FoldElem>(inputs: &[Vec<E>], op: ReduceOp, round_each_sum: bool) -> Vec<E> {
    let size = inputs.first().map_or(0, Vec::len);
    (0..size)
        .map(|i| {
            let mut sum = inputs[0][i].to_f32();
            for input in &inputs[1..] {
                sum += input[i].to_f32();
                if round_each_sum {
                    sum = E::from_f32(sum).to_f32();
                }
            }
            if op == ReduceOp::Mean {
                sum /= inputs.len() as f32;
            }
            E::from_f32(sum)
        })
        .collect()
}

/// All-reduce (sum and mean) and reduce-scatter (sum) of seeded non-integer values of dtype `E`
/// on `group`, compared bit for bit with [`serial_fold`]. Where three or more ranks take part
/// and there are many elements, it also proves the values tell the serial fold from another:
/// the reverse fold (which differs in f32) or the fold that rounds every partial sum (which
/// differs in bf16, whose single rounding at the end hides the order of f32 sums) gives other
/// bits somewhere.
fn check_folds<E: FoldElem>(
    group: &ProcessGroup,
    size: usize,
    summary: &mut CheckSummary,
) -> Result<(), String> {
    let inputs: Vec<Vec<E>> = group
        .global_ranks()
        .iter()
        .map(|&g| fold_input::<E>(g, size))
        .collect();
    let mine = || HostTensor::new(inputs[group.rank()].clone(), vec![size, 1]);
    let context = |what: &str| {
        format!(
            "fold check: {what} of seeded {:?} values on {} (rank {}), size {size}",
            E::DTYPE,
            group.describe(),
            group.global_rank()
        )
    };
    let compare = |what: &str, got: &[E], want: &[E]| -> Result<(), String> {
        if got.len() != want.len() {
            return Err(format!(
                "{}: {} elements, expected {}",
                context(what),
                got.len(),
                want.len()
            ));
        }
        match got.iter().zip(want).position(|(a, b)| a.bits() != b.bits()) {
            None => Ok(()),
            Some(i) => Err(format!(
                "{}: element {i} is {} (bits {:#x}), the serial fold gives {} (bits {:#x})",
                context(what),
                got[i].to_f32(),
                got[i].bits(),
                want[i].to_f32(),
                want[i].bits()
            )),
        }
    };
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let what = format!("all_reduce {op:?}");
        let want = serial_fold(&inputs, op, false);
        let got = group
            .all_reduce_host(mine(), op)
            .map_err(|e| format!("{}: {e}", context(&what)))?;
        compare(&what, &got.data, &want)?;
        summary.checks += 1;
        summary.fold_checks += 1;
    }
    let sum = serial_fold(&inputs, ReduceOp::Sum, false);
    let part = split_ranges(size, group.size())[group.rank()].clone();
    let got = group
        .reduce_scatter_host(mine(), 0, ReduceOp::Sum)
        .map_err(|e| format!("{}: {e}", context("reduce_scatter Sum")))?;
    compare("reduce_scatter Sum", &got.data, &sum[part])?;
    summary.checks += 1;
    summary.fold_checks += 1;

    if group.size() >= 3 && size >= FOLD_SIZE {
        let reversed: Vec<Vec<E>> = inputs.iter().rev().cloned().collect();
        let others = [
            serial_fold(&reversed, ReduceOp::Sum, false),
            serial_fold(&inputs, ReduceOp::Sum, true),
        ];
        let same = |other: &Vec<E>| other.iter().zip(&sum).all(|(a, b)| a.bits() == b.bits());
        if others.iter().all(same) {
            return Err(context(
                "the reverse fold and the fold rounding every sum give the serial fold's bits: \
                 the values tell no fold from another",
            ));
        }
    }
    Ok(())
}

struct Ctx<'a, B: Backend> {
    group: &'a ProcessGroup,
    device: &'a B::Device,
    dtype: DType,
    size: usize,
    summary: &'a mut CheckSummary,
}

fn stamp(global_rank: usize, index: usize) -> f64 {
    (global_rank + index % 3) as f64
}

impl<B: Backend> Ctx<'_, B> {
    fn n(&self) -> usize {
        self.group.size()
    }
    fn g(&self, q: usize) -> usize {
        self.group.global_ranks()[q]
    }
    fn sum_g(&self) -> f64 {
        self.group.global_ranks().iter().sum::<usize>() as f64
    }

    /// Rank q's input of shape `shape`.
    fn input<K: BasicOps<B>>(&self, q: usize, shape: [usize; 2]) -> Tensor<B, 2, K>
    where
        K::Elem: Element,
    {
        let values: Vec<f64> = (0..shape[0] * shape[1])
            .map(|i| stamp(self.g(q), i))
            .collect();
        let data = TensorData::new(values, shape).convert_dtype(self.dtype);
        Tensor::from_data(data, (self.device, self.dtype))
    }

    fn mine<K: BasicOps<B>>(&self, shape: [usize; 2]) -> Tensor<B, 2, K>
    where
        K::Elem: Element,
    {
        self.input(self.group.rank(), shape)
    }

    /// Compares a result with `expected(row, col)` exactly.
    fn expect<K: BasicOps<B>>(
        &mut self,
        what: &str,
        got: Result<Tensor<B, 2, K>, super::CommError>,
        shape: [usize; 2],
        expected: impl Fn(usize, usize) -> f64,
    ) -> Result<(), String>
    where
        K::Elem: Element,
    {
        let context = format!(
            "{what} on {} (rank {}), dtype {:?}, size {}",
            self.group.describe(),
            self.group.global_rank(),
            self.dtype,
            self.size
        );
        let got = got.map_err(|e| format!("{context}: {e}"))?;
        if got.dims() != shape || got.dtype() != self.dtype {
            return Err(format!(
                "{context}: got shape {:?} dtype {:?}, expected {shape:?} {:?}",
                got.dims(),
                got.dtype(),
                self.dtype
            ));
        }
        let data = aligned(got.into_data());
        for (i, value) in data.iter::<f64>().enumerate() {
            let want = expected(i / shape[1].max(1), i % shape[1].max(1));
            if value != want {
                return Err(format!(
                    "{context}: element {i} is {value}, expected {want}"
                ));
            }
        }
        self.summary.checks += 1;
        Ok(())
    }

    fn all_ops<K: BasicOps<B> + 'static>(&mut self) -> Result<(), String>
    where
        K::Elem: Element,
    {
        let (n, s, me) = (self.n(), self.size, self.group.rank());
        let column = [s, 1];
        // Three rows; at the large size the same bytes as the column, not three times as many.
        let ws = if s * self.dtype.size() >= LARGE_BYTES {
            s / 3
        } else {
            s
        };
        let wide = [3, ws];
        let int = !self.dtype.is_float();

        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Mean] {
            if op == ReduceOp::Mean && !int && !n.is_power_of_two() {
                self.summary
                    .skipped
                    .push(format!("mean over {} ranks has no exact float result", n));
                continue;
            }
            let (sum, max, min) = (self.sum_g(), self.g(n - 1) as f64, self.g(0) as f64);
            let out = self.group.all_reduce(self.mine::<K>(column), op);
            self.expect(&format!("all_reduce {op:?}"), out, column, |i, _| {
                let p = (i % 3) as f64;
                match op {
                    ReduceOp::Sum => sum + n as f64 * p,
                    ReduceOp::Max => max + p,
                    ReduceOp::Min => min + p,
                    ReduceOp::Mean if int => ((sum + n as f64 * p) / n as f64).trunc(),
                    ReduceOp::Mean => (sum + n as f64 * p) / n as f64,
                }
            })?;
        }

        let globals: Vec<usize> = self.group.global_ranks().to_vec();
        let out = self.group.all_gather(self.mine::<K>(column), 0);
        self.expect("all_gather dim 0", out, [n * s, 1], |i, _| {
            stamp(globals[i / s.max(1)], i % s.max(1))
        })?;
        let out = self.group.all_gather(self.mine::<K>(wide), 1);
        self.expect("all_gather dim 1", out, [3, n * ws], |r, c| {
            stamp(globals[c / ws.max(1)], r * ws + c % ws.max(1))
        })?;

        let rows = split_ranges(s, n)[me].clone();
        let wide_rows = split_ranges(ws, n)[me].clone();
        let sum = self.sum_g();
        let reduced = |i: usize| sum + (n * (i % 3)) as f64;
        let out = self
            .group
            .reduce_scatter(self.mine::<K>(column), 0, ReduceOp::Sum);
        self.expect("reduce_scatter dim 0", out, [rows.len(), 1], |i, _| {
            reduced(rows.start + i)
        })?;
        let out = self
            .group
            .reduce_scatter(self.mine::<K>(wide), 1, ReduceOp::Sum);
        self.expect("reduce_scatter dim 1", out, [3, wide_rows.len()], |r, c| {
            reduced(r * ws + wide_rows.start + c)
        })?;

        let root = n - 1;
        let out = self.group.broadcast(self.mine::<K>(column), root);
        self.expect("broadcast", out, column, |i, _| stamp(globals[root], i))?;

        let len = rows.len();
        let out = self.group.all_to_all(self.mine::<K>(column), 0, 0);
        self.expect("all_to_all 0→0", out, [n * len, 1], |i, _| {
            stamp(globals[i / len.max(1)], rows.start + i % len.max(1))
        })?;
        let out = self.group.all_to_all(self.mine::<K>(wide), 1, 0);
        self.expect("all_to_all 1→0", out, [3 * n, wide_rows.len()], |r, c| {
            stamp(globals[r / 3], (r % 3) * ws + wide_rows.start + c)
        })?;

        if n > 1 {
            let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
            let tag = 1000 + s as u64;
            self.group
                .send(self.mine::<K>(column), next, tag)
                .map_err(|e| e.to_string())?;
            let out = self.group.recv::<B, 2, K>(prev, tag, self.device);
            self.expect("send/recv", out, column, |i, _| stamp(globals[prev], i))?;
        }
        self.group.barrier().map_err(|e| e.to_string())
    }
}
