//! Rank-stamped exactness checks of every collective, over any world: the thread tests, the
//! process tests (`wildfire launch … -- wildfire comm-check`) and users checking a new cluster
//! run the same code.
//!
//! Rank r's tensor holds `x_r[i] = g_r + (i mod 3)` (g_r its global rank, i the flat index), so
//! every result is a small integer (or a half, for means) that f16, bf16 and the integer types
//! hold exactly: results are compared with `==`, no tolerance. Checks run on the world and on
//! each half of it, in f32, f16, bf16, i32 and i64, for sizes 0, 1, 7, n+1 (not divisible by
//! the group size n) and 4 MiB, along dimension 0 and, for the dimension-aware ops, dimension 1.

use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, DType, Element, Float, Int, Tensor, TensorData};

use super::element::ReduceOp;
use super::group::ProcessGroup;
use super::layout::split_ranges;
use crate::host_data::aligned;

/// What a run checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckSummary {
    /// Collective calls whose result was compared element by element.
    pub checks: usize,
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
    }
    Ok(summary)
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
