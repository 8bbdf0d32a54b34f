//! The plan of a vendor GEMM (cuBLASLt's) for Burn's matmul: which calls, with which
//! column-major layouts, leading dimensions and batch strides, compute
//! `out[.., i, j] = Σₗ lhs[.., i, l]·rhs[.., l, j]` on the operands' memory as it lies, transposes
//! as layout flags and broadcast batches as zero strides, never a copy.
//!
//! **Row-major as column-major.** Burn's output is a fresh row-major `[.., m, n]`; a row-major
//! `X[r, c]` with row stride `ld` is, read column-major, `Xᵀ[c, r]` with leading dimension `ld`.
//! So the vendor call computes `outᵀ = rhsᵀ·lhsᵀ` column-major: its `A` is the rhs buffer, its
//! `B` the lhs buffer, its `(m, n, k)` Burn's `(n, m, k)`, and `ldc = n`. An operand stored
//! row-major (`strides [ld, 1]`) is already the transposed matrix the call wants (`op = N`); one
//! stored column-major (`strides [1, ld]`, a transposed view such as `x.transpose()`) is the
//! matrix itself and is read with `op = T`. A matrix with any other strides (a zero or a
//! non-unit stride on both axes) would need a copy: the plan declines and the caller's other
//! tier runs.
//!
//! **Batches.** Batch dimensions broadcast as Burn's do (a dimension of 1 against any size); an
//! operand's effective stride along a broadcast dimension is 0, and output dimensions of size 1
//! play no part. The innermost batch dimensions whose effective strides nest
//! (`stride[d] = stride[inner]·(the sizes merged so far)` for every operand, the output
//! included) merge into one strided-batched call; each combination of the outer ones is a call
//! of its own with its own base offsets.
//!
//! **Types** ([`gemm_types`]): both inputs of one type, f32, f16 or bf16, with the output in
//! that type or, for f16 and bf16, in f32 (the product an epilogue reads); always accumulated
//! in f32, f32 inputs as full f32 products unless the precision policy is `tf32`.

use burn::tensor::DType;

use super::MatmulPrecision;

/// The types of one vendor GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmTypes {
    /// Both inputs' type.
    pub input: DType,
    /// The output's type: the input's, or f32.
    pub output: DType,
    /// f32 inputs on TF32 tensor cores.
    pub tf32: bool,
}

/// The types of a vendor GEMM of `lhs` and `rhs` giving `output` under `precision`, or why the
/// tier does not take them (see the module doc).
pub fn gemm_types(
    lhs: DType,
    rhs: DType,
    output: DType,
    precision: MatmulPrecision,
) -> Result<GemmTypes, String> {
    if lhs != rhs {
        return Err(format!("inputs of two types, {lhs:?} and {rhs:?}"));
    }
    if ![DType::F32, DType::F16, DType::BF16].contains(&lhs) {
        return Err(format!("inputs in {lhs:?} (f32, f16 and bf16 are taken)"));
    }
    if output != lhs && output != DType::F32 {
        return Err(format!(
            "{lhs:?} inputs with a {output:?} output (the inputs' type or f32)"
        ));
    }
    let tf32 = lhs == DType::F32 && precision == MatmulPrecision::Tf32;
    Ok(GemmTypes {
        input: lhs,
        output,
        tf32,
    })
}

/// One strided-batched GEMM, column-major, in cuBLAS's terms: for `b < batch`,
/// `C_b = op_a(A_b)·op_b(B_b)` with `X_b` at `offset_x + b·stride_x` (elements) and
/// `X[r, c]` at `r + c·ldx`. `A` is the rhs buffer, `B` the lhs buffer, `C` the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmCall {
    /// Rows of `C` and of `op_a(A)`: Burn's `n`.
    pub m: usize,
    /// Columns of `C` and of `op_b(B)`: Burn's `m`.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// `op_a = T`: `A` is stored `k × m`.
    pub transpose_a: bool,
    /// `op_b = T`: `B` is stored `n × k`.
    pub transpose_b: bool,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    pub batch: usize,
    pub stride_a: usize,
    pub stride_b: usize,
    pub stride_c: usize,
    pub offset_a: usize,
    pub offset_b: usize,
    pub offset_c: usize,
}

impl GemmCall {
    /// `A`'s stored layout, `(rows, cols)`, as cuBLASLt's matrix layout describes it.
    pub fn layout_a(&self) -> (usize, usize) {
        match self.transpose_a {
            false => (self.m, self.k),
            true => (self.k, self.m),
        }
    }

    /// `B`'s stored layout, `(rows, cols)`.
    pub fn layout_b(&self) -> (usize, usize) {
        match self.transpose_b {
            false => (self.k, self.n),
            true => (self.n, self.k),
        }
    }
}

/// The calls of one matmul and the output's shape (row-major, contiguous, fresh).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GemmPlan {
    pub calls: Vec<GemmCall>,
    pub out_shape: Vec<usize>,
}

/// A strided view: sizes and strides in elements, from the buffer's start (its offset is the
/// caller's).
#[derive(Clone, Copy, Debug)]
pub struct StridedView<'a> {
    pub shape: &'a [usize],
    pub strides: &'a [usize],
}

/// A matrix's storage order and leading dimension, as the column-major call reads it: `true`
/// when the buffer holds the matrix's transpose column-major (row-major storage, `op = N` for
/// the swapped product), with the leading dimension.
fn row_major(
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
) -> Option<(bool, usize)> {
    // With one row (column), that axis's stride is never used: any leading dimension at least
    // the other axis's length describes it.
    if (col_stride == 1 || cols == 1) && (rows == 1 || row_stride >= cols.max(1)) {
        let ld = if rows == 1 { cols } else { row_stride };
        return Some((true, ld.max(1)));
    }
    if (row_stride == 1 || rows == 1) && (cols == 1 || col_stride >= rows.max(1)) {
        let ld = if cols == 1 { rows } else { col_stride };
        return Some((false, ld.max(1)));
    }
    None
}

/// The plan of `lhs [.., m, k] · rhs [.., k, n]`, or why there is none (the caller runs another
/// tier).
pub fn plan(lhs: StridedView, rhs: StridedView) -> Result<GemmPlan, String> {
    let rank = lhs.shape.len();
    if rank < 2 || rhs.shape.len() != rank || lhs.strides.len() != rank || rhs.strides.len() != rank
    {
        return Err(format!(
            "shapes {:?} and {:?} (strides {:?}, {:?}) are not two matrices of one rank",
            lhs.shape, rhs.shape, lhs.strides, rhs.strides
        ));
    }
    let batch_dims = rank - 2;
    let [m, k] = [lhs.shape[batch_dims], lhs.shape[batch_dims + 1]];
    let [k_rhs, n] = [rhs.shape[batch_dims], rhs.shape[batch_dims + 1]];
    if k != k_rhs {
        return Err(format!(
            "inner dimensions differ: {:?} · {:?}",
            lhs.shape, rhs.shape
        ));
    }
    if m == 0 || n == 0 || k == 0 {
        return Err(format!(
            "an empty product: {:?} · {:?}",
            lhs.shape, rhs.shape
        ));
    }
    let mut batch = Vec::with_capacity(batch_dims);
    for d in 0..batch_dims {
        let (l, r) = (lhs.shape[d], rhs.shape[d]);
        if l != r && l != 1 && r != 1 {
            return Err(format!(
                "batch dimension {d} does not broadcast: {:?} · {:?}",
                lhs.shape, rhs.shape
            ));
        }
        batch.push(l.max(r));
    }

    // The swapped product: the call's A is rhs (Burn's k × n, read as n × k), B is lhs.
    let [rs, cs] = [rhs.strides[batch_dims], rhs.strides[batch_dims + 1]];
    let (a_row_major, lda) = row_major(k, n, rs, cs)
        .ok_or_else(|| format!("rhs strides {:?} need a copy", rhs.strides))?;
    let [rs, cs] = [lhs.strides[batch_dims], lhs.strides[batch_dims + 1]];
    let (b_row_major, ldb) = row_major(m, k, rs, cs)
        .ok_or_else(|| format!("lhs strides {:?} need a copy", lhs.strides))?;

    // The batch dimensions of more than one output index, each with its effective strides for
    // A (rhs), B (lhs) and C: 0 along an operand's broadcast dimension; C is contiguous.
    let mut live = Vec::new();
    let mut c_stride = m * n;
    for d in (0..batch_dims).rev() {
        if batch[d] > 1 {
            let effective = |view: StridedView| match view.shape[d] {
                1 => 0,
                _ => view.strides[d],
            };
            live.push((batch[d], [effective(rhs), effective(lhs), c_stride]));
        }
        c_stride *= batch[d];
    }
    live.reverse();

    // The innermost live dimensions whose strides nest, for every operand, form one
    // strided-batched call.
    let (mut first, mut run) = (live.len(), 1);
    if let Some(&(size, _)) = live.last() {
        first -= 1;
        run = size;
        let inner = live[first].1;
        while first > 0 && (0..3).all(|x| live[first - 1].1[x] == inner[x] * run) {
            first -= 1;
            run *= live[first].0;
        }
    }
    let inner = live.last().map_or([0; 3], |&(_, strides)| strides);
    let template = GemmCall {
        m: n,
        n: m,
        k,
        transpose_a: !a_row_major,
        transpose_b: !b_row_major,
        lda,
        ldb,
        ldc: n,
        batch: run,
        stride_a: inner[0],
        stride_b: inner[1],
        stride_c: inner[2],
        offset_a: 0,
        offset_b: 0,
        offset_c: 0,
    };

    // One call per combination of the outer live dimensions `0..first`.
    let outer: usize = live[..first].iter().map(|&(size, _)| size).product();
    let mut calls = Vec::with_capacity(outer);
    for mut flat in 0..outer {
        let mut call = template;
        for &(size, strides) in live[..first].iter().rev() {
            let index = flat % size;
            flat /= size;
            call.offset_a += index * strides[0];
            call.offset_b += index * strides[1];
            call.offset_c += index * strides[2];
        }
        calls.push(call);
    }
    let mut out_shape = batch;
    out_shape.extend([m, n]);
    Ok(GemmPlan { calls, out_shape })
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::{Tensor, TensorData};

    use super::*;

    /// What a column-major BLAS computes from `call` on flat buffers: the meaning of the
    /// descriptors, element by element.
    fn run_call(call: &GemmCall, a: &[f32], b: &[f32], c: &mut [f32]) {
        for batch in 0..call.batch {
            let (a0, b0) = (
                call.offset_a + batch * call.stride_a,
                call.offset_b + batch * call.stride_b,
            );
            let c0 = call.offset_c + batch * call.stride_c;
            for j in 0..call.n {
                for i in 0..call.m {
                    let mut sum = 0.0f32;
                    for l in 0..call.k {
                        let x = match call.transpose_a {
                            false => a[a0 + i + l * call.lda],
                            true => a[a0 + l + i * call.lda],
                        };
                        let y = match call.transpose_b {
                            false => b[b0 + l + j * call.ldb],
                            true => b[b0 + j + l * call.ldb],
                        };
                        sum += x * y;
                    }
                    c[c0 + i + j * call.ldc] = sum;
                }
            }
        }
    }

    fn run(plan: &GemmPlan, lhs: &[f32], rhs: &[f32]) -> Vec<f32> {
        let mut out = vec![f32::NAN; plan.out_shape.iter().product()];
        for call in &plan.calls {
            run_call(call, rhs, lhs, &mut out);
        }
        out
    }

    /// Small integers, so every product and sum below is exact in f32 in any order.
    fn values(count: usize, seed: usize) -> Vec<f32> {
        (0..count)
            .map(|i| ((i * 7 + seed * 13) % 9) as f32 - 4.0)
            .collect()
    }

    /// A logical tensor of `shape` whose memory is laid out with its dimensions in `order`
    /// (outermost first): the buffer, and the logical view's strides.
    fn stored(shape: &[usize], order: &[usize], seed: usize) -> (Vec<f32>, Vec<usize>) {
        let count = shape.iter().product();
        let buffer = values(count, seed);
        let mut strides = vec![0; shape.len()];
        let mut size = 1;
        for &d in order.iter().rev() {
            strides[d] = size;
            size *= shape[d];
        }
        (buffer, strides)
    }

    /// The logical values of a strided view, row-major.
    fn logical(buffer: &[f32], shape: &[usize], strides: &[usize]) -> Vec<f32> {
        let count: usize = shape.iter().product();
        (0..count)
            .map(|mut flat| {
                let mut at = 0;
                for d in (0..shape.len()).rev() {
                    at += (flat % shape[d]) * strides[d];
                    flat /= shape[d];
                }
                buffer[at]
            })
            .collect()
    }

    fn burn_matmul(
        lhs: Vec<f32>,
        lhs_shape: &[usize],
        rhs: Vec<f32>,
        rhs_shape: &[usize],
    ) -> Vec<f32> {
        let device = Default::default();
        let tensor = |values: Vec<f32>, shape: &[usize]| {
            let mut padded = vec![1; 4 - shape.len()];
            padded.extend_from_slice(shape);
            Tensor::<Flex, 4>::from_data(TensorData::new(values, padded), &device)
        };
        let out = tensor(lhs, lhs_shape).matmul(tensor(rhs, rhs_shape));
        out.into_data().to_vec().unwrap()
    }

    /// The plan of `lhs · rhs` stored in the given dimension orders, executed as a BLAS would,
    /// equals Burn's matmul of the same logical tensors.
    fn check(
        lhs_shape: &[usize],
        lhs_order: &[usize],
        rhs_shape: &[usize],
        rhs_order: &[usize],
    ) -> GemmPlan {
        let (lhs, lhs_strides) = stored(lhs_shape, lhs_order, 1);
        let (rhs, rhs_strides) = stored(rhs_shape, rhs_order, 2);
        let view = |shape, strides| StridedView { shape, strides };
        let plan = plan(view(lhs_shape, &lhs_strides), view(rhs_shape, &rhs_strides)).unwrap();
        let ours = run(&plan, &lhs, &rhs);
        let theirs = burn_matmul(
            logical(&lhs, lhs_shape, &lhs_strides),
            lhs_shape,
            logical(&rhs, rhs_shape, &rhs_strides),
            rhs_shape,
        );
        assert_eq!(ours.len(), theirs.len());
        let what =
            format!("{lhs_shape:?} (order {lhs_order:?}) · {rhs_shape:?} (order {rhs_order:?})");
        assert!(
            ours == theirs,
            "{what}: the plan's product differs from Burn's"
        );
        plan
    }

    const ROW: [usize; 2] = [0, 1];
    const COL: [usize; 2] = [1, 0];

    #[test]
    fn odd_and_transposed_matrices_multiply_as_burn_does() {
        for (m, k, n) in [
            (1, 1, 1),
            (17, 65, 1),
            (1, 4097, 17),
            (65, 17, 4097),
            (17, 1, 65),
        ] {
            for lhs_order in [ROW, COL] {
                for rhs_order in [ROW, COL] {
                    let plan = check(&[m, k], &lhs_order, &[k, n], &rhs_order);
                    assert_eq!(plan.calls.len(), 1);
                    assert_eq!(
                        (plan.calls[0].m, plan.calls[0].n, plan.calls[0].k),
                        (n, m, k)
                    );
                }
            }
        }
    }

    #[test]
    fn contiguous_batches_are_one_strided_call() {
        let plan = check(&[2, 3, 17, 5], &[0, 1, 2, 3], &[2, 3, 5, 65], &[0, 1, 2, 3]);
        assert_eq!(plan.calls.len(), 1);
        let call = plan.calls[0];
        assert_eq!(
            (call.batch, call.stride_a, call.stride_b, call.stride_c),
            (6, 5 * 65, 17 * 5, 17 * 65)
        );
        // Each batch's matrix transposed (the heads' keys, as attention reads them).
        let plan = check(&[2, 3, 17, 5], &[0, 1, 2, 3], &[2, 3, 5, 65], &[0, 1, 3, 2]);
        assert_eq!(plan.calls.len(), 1);
        assert!(plan.calls[0].transpose_a);
    }

    #[test]
    fn broadcast_batches_read_with_a_zero_stride() {
        // One rhs for every batch (a weight against a batch of activations).
        let plan = check(&[4, 17, 5], &[0, 1, 2], &[1, 5, 65], &[0, 1, 2]);
        assert_eq!(plan.calls.len(), 1);
        assert_eq!((plan.calls[0].batch, plan.calls[0].stride_a), (4, 0));
        // Broadcast along the outer dimension only: the inner one runs strided, the outer
        // ones are calls of their own.
        let plan = check(&[2, 3, 17, 5], &[0, 1, 2, 3], &[1, 3, 5, 65], &[0, 1, 2, 3]);
        assert_eq!(plan.calls.len(), 2);
        assert_eq!(plan.calls[1].offset_a, 0, "the broadcast rhs starts over");
        check(&[2, 1, 17, 5], &[0, 1, 2, 3], &[1, 3, 5, 65], &[0, 1, 3, 2]);
        check(&[1, 1, 1, 5], &[0, 1, 2, 3], &[3, 2, 5, 1], &[2, 1, 3, 0]);
    }

    #[test]
    fn permuted_batches_become_calls_with_their_own_offsets() {
        // lhs's batch dimensions stored swapped: they do not nest, so each outer index is a call.
        let plan = check(&[2, 3, 17, 5], &[1, 0, 2, 3], &[2, 3, 5, 65], &[0, 1, 2, 3]);
        assert_eq!(plan.calls.len(), 2);
        // The rhs's batch dimension between its matrix axes: still strided, no copy.
        check(&[3, 17, 5], &[0, 1, 2], &[3, 5, 4], &[1, 0, 2]);
    }

    #[test]
    fn layouts_that_need_a_copy_are_declined() {
        let view = |shape, strides| StridedView { shape, strides };
        // Every second column: neither axis has a unit stride.
        let declined = plan(view(&[4, 3], &[6, 2]), view(&[3, 2], &[2, 1])).unwrap_err();
        assert!(
            declined.contains("lhs strides [6, 2] need a copy"),
            "{declined}"
        );
        // A batch dimension innermost leaves the matrices no unit stride.
        let declined = plan(view(&[3, 4, 2], &[1, 6, 3]), view(&[3, 2, 2], &[4, 2, 1]));
        assert!(
            declined
                .unwrap_err()
                .contains("lhs strides [1, 6, 3] need a copy")
        );
        // A broadcast row (stride 0 across rows) is not a matrix a BLAS reads.
        assert!(plan(view(&[4, 3], &[1, 1]), view(&[3, 2], &[0, 1])).is_err());
        let declined =
            plan(view(&[2, 4, 3], &[12, 3, 1]), view(&[3, 3, 2], &[6, 2, 1])).unwrap_err();
        assert!(
            declined.contains("batch dimension 0 does not broadcast"),
            "{declined}"
        );
        let declined = plan(view(&[4, 3], &[3, 1]), view(&[2, 2], &[2, 1])).unwrap_err();
        assert!(declined.contains("inner dimensions differ"), "{declined}");
        assert!(plan(view(&[0, 3], &[3, 1]), view(&[3, 2], &[2, 1])).is_err());
    }

    #[test]
    fn the_vendor_call_takes_one_float_type_in_and_that_type_or_f32_out() {
        use MatmulPrecision::{Bf16, Off, Tf32};
        let bf16 = gemm_types(DType::BF16, DType::BF16, DType::BF16, Bf16).unwrap();
        assert_eq!(
            (bf16.input, bf16.output, bf16.tf32),
            (DType::BF16, DType::BF16, false)
        );
        let into_f32 = gemm_types(DType::F16, DType::F16, DType::F32, Off).unwrap();
        assert_eq!((into_f32.input, into_f32.output), (DType::F16, DType::F32));
        assert!(
            !gemm_types(DType::F32, DType::F32, DType::F32, Off)
                .unwrap()
                .tf32
        );
        assert!(
            gemm_types(DType::F32, DType::F32, DType::F32, Tf32)
                .unwrap()
                .tf32
        );
        assert!(
            !gemm_types(DType::BF16, DType::BF16, DType::F32, Tf32)
                .unwrap()
                .tf32
        );

        let refused = [
            (
                DType::F16,
                DType::BF16,
                DType::F32,
                "inputs of two types, F16 and BF16",
            ),
            (DType::F64, DType::F64, DType::F64, "inputs in F64"),
            (
                DType::F32,
                DType::F32,
                DType::BF16,
                "F32 inputs with a BF16 output",
            ),
            (
                DType::F16,
                DType::F16,
                DType::BF16,
                "F16 inputs with a BF16 output",
            ),
        ];
        for (lhs, rhs, output, reason) in refused {
            let error = gemm_types(lhs, rhs, output, Off).unwrap_err();
            assert!(error.contains(reason), "{error}");
        }
    }
}
