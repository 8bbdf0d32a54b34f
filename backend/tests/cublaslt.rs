//! cuBLASLt's GEMM, the matmuls' vendor tier (`cuda::cublaslt`, `kernels::matmul::vendor`), on
//! CUDA (`--features cuda`; `scripts/gpu-check.sh`), against an f64 product of the same rounded
//! inputs, on fresh random data in [−2, 2): odd sizes (1, 17, 65, 4097), operands transposed as
//! views (read with `op = T`, never copied), batched, and broadcast either way.
//!
//! The bound is on each element's error relative to `Σₗ|aₗbₗ|`, the sum of its products'
//! magnitudes: f32 ≤ 1e-5, TF32 ≤ 1e-3, f16 and bf16 ≤ 1e-2 (half-precision outputs are
//! rounded, 2⁻⁸ relative for bf16). Without a CUDA device each test reports itself skipped,
//! unless `WILDFIRE_REQUIRE_CUDA=1` makes that a failure.

use burn::backend::Cuda;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData, TensorPrimitive};
use wildfire_backend::Parallel;
use wildfire_backend::compare::{assert_same_length, nan_max};
use wildfire_backend::cuda::cublaslt;
use wildfire_backend::device::FusedCuda;
use wildfire_backend::kernels::matmul::gemm_plan::GemmTypes;
use wildfire_backend::kernels::matmul::vendor;
use wildfire_backend::kernels::route::{KernelPath, kernel_paths};

use crate::common::{KernelBackend, alone_in_a_process, rounded, signed_values};

/// `[lhs batch, m, k] · [rhs batch, k, n]`, each operand stored transposed or not.
#[derive(Clone, Copy, Debug)]
struct Case {
    batches: [usize; 2],
    m: usize,
    k: usize,
    n: usize,
    transposed: [bool; 2],
}

const fn case(batches: [usize; 2], [m, k, n]: [usize; 3], transposed: [bool; 2]) -> Case {
    Case {
        batches,
        m,
        k,
        n,
        transposed,
    }
}

const CASES: [Case; 7] = [
    case([1, 1], [1, 4097, 17], [false, false]),
    case([1, 1], [65, 17, 1], [true, false]),
    case([1, 1], [17, 65, 4097], [false, true]),
    case([1, 1], [1, 1, 1], [true, true]),
    case([3, 3], [17, 65, 33], [false, true]),
    case([1, 3], [17, 33, 65], [true, true]),
    case([2, 1], [65, 17, 17], [true, false]),
];

impl Case {
    /// Fresh values in [−2, 2) for both operands (streams `2·seed + 1` and `2·seed + 2`), and the
    /// operands on `device` in `dtype`, each stored transposed or not as the case says.
    fn operands<B: Backend>(
        &self,
        seed: u64,
        dtype: FloatDType,
        device: &B::Device,
    ) -> ([Vec<f32>; 2], [Tensor<B, 3>; 2]) {
        let Case { m, k, n, .. } = *self;
        let shapes = [[self.batches[0], m, k], [self.batches[1], k, n]];
        let values = [0, 1].map(|i| {
            let [batch, rows, cols] = shapes[i];
            signed_values(batch * rows * cols, 2 * seed + 1 + i as u64, 2.0)
        });
        let tensors =
            [0, 1].map(|i| operand::<B>(&values[i], shapes[i], self.transposed[i], dtype, device));
        (values, tensors)
    }
}

/// A `[batch, rows, cols]` operand of `values` (row-major, logical), stored transposed when
/// asked: a `[batch, cols, rows]` tensor seen through `swap_dims`.
fn operand<B: Backend>(
    values: &[f32],
    [batch, rows, cols]: [usize; 3],
    transposed: bool,
    dtype: FloatDType,
    device: &B::Device,
) -> Tensor<B, 3> {
    let tensor = match transposed {
        false => Tensor::<B, 3>::from_data(
            TensorData::new(values.to_vec(), [batch, rows, cols]),
            device,
        ),
        true => {
            let mut stored = vec![0.0; values.len()];
            for b in 0..batch {
                for r in 0..rows {
                    for c in 0..cols {
                        stored[(b * cols + c) * rows + r] = values[(b * rows + r) * cols + c];
                    }
                }
            }
            Tensor::<B, 3>::from_data(TensorData::new(stored, [batch, cols, rows]), device)
                .swap_dims(1, 2)
        }
    };
    tensor.cast(dtype)
}

/// The exact product of the rounded inputs and each element's `Σₗ|aₗbₗ|`.
fn exact(case: Case, lhs: &[f32], rhs: &[f32], dtype: FloatDType) -> (Vec<f64>, Vec<f64>) {
    let Case { m, k, n, .. } = case;
    let batch = case.batches[0].max(case.batches[1]);
    let (mut product, mut magnitude) = (Vec::new(), Vec::new());
    for b in 0..batch {
        let (bl, br) = (b % case.batches[0], b % case.batches[1]);
        for i in 0..m {
            for j in 0..n {
                let (mut sum, mut size) = (0.0, 0.0);
                for l in 0..k {
                    let x = rounded(lhs[(bl * m + i) * k + l], dtype);
                    let y = rounded(rhs[(br * k + l) * n + j], dtype);
                    sum += x * y;
                    size += (x * y).abs();
                }
                product.push(sum);
                magnitude.push(size);
            }
        }
    }
    (product, magnitude)
}

/// The worst error of `got` relative to each element's `Σₗ|aₗbₗ|` (NaN when any is NaN).
fn worst_relative(got: &[f64], exact: &[f64], magnitude: &[f64]) -> f64 {
    assert_same_length(got.len(), exact.len());
    nan_max(
        (got.iter().zip(exact).zip(magnitude))
            .map(|((g, e), s)| (g - e).abs() / s.max(f64::MIN_POSITIVE)),
    )
}

fn values_of<B: Backend>(tensor: Tensor<B, 3>) -> Vec<f64> {
    let data = tensor.into_data().convert::<f32>();
    data.to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

/// Every case through `cublaslt::matmul` directly, in `types`, within `bound`.
fn check(types: GemmTypes, bound: f64) {
    let Some(device) = Cuda::test_device() else {
        return;
    };
    let dtype = FloatDType::from(types.input);
    for (seed, case) in CASES.into_iter().enumerate() {
        let ([lhs_values, rhs_values], operands) =
            case.operands::<Cuda>(seed as u64, dtype, &device);
        let [lhs, rhs] = operands.map(|t| t.into_primitive().tensor());
        let product = cublaslt::matmul(&lhs, &rhs, types)
            .unwrap_or_else(|reason| panic!("{case:?} in {types:?}: cuBLASLt declined: {reason}"));
        assert_eq!(product.dtype, types.output);
        let got = values_of(Tensor::<Cuda, 3>::from_primitive(TensorPrimitive::Float(
            product,
        )));
        let (exact, magnitude) = exact(case, &lhs_values, &rhs_values, dtype);
        let worst = worst_relative(&got, &exact, &magnitude);
        println!("{case:?} in {types:?}: worst relative error {worst:.2e}");
        assert!(
            worst <= bound,
            "{case:?} in {types:?}: relative error {worst:e} over {bound:e}"
        );
    }
}

fn types(input: DType, output: DType, tf32: bool) -> GemmTypes {
    GemmTypes {
        input,
        output,
        tf32,
    }
}

#[test]
fn f32_products_match_f64() {
    check(types(DType::F32, DType::F32, false), 1e-5);
}

#[test]
fn tf32_products_match_f64() {
    check(types(DType::F32, DType::F32, true), 1e-3);
}

#[test]
fn bf16_products_match_f64_in_bf16_and_in_f32() {
    check(types(DType::BF16, DType::BF16, false), 1e-2);
    check(types(DType::BF16, DType::F32, false), 1e-5);
}

#[test]
fn f16_products_match_f64_in_f16_and_in_f32() {
    check(types(DType::F16, DType::F16, false), 1e-2);
    check(types(DType::F16, DType::F32, false), 1e-5);
}

/// With the tier on, a matmul of `Parallel<Cuda>` and of `Parallel<FusedCuda>` (a transposed
/// rhs, batched) runs on cuBLASLt (counted on the vendor path) and gives the f64 product. Alone in
/// a process: the tier is a process-wide switch.
#[test]
fn with_the_tier_on_the_decorators_matmuls_run_on_cublaslt() {
    if !alone_in_a_process("cublaslt::with_the_tier_on_the_decorators_matmuls_run_on_cublaslt") {
        return;
    }
    let Some(device) = Cuda::test_device() else {
        return;
    };
    vendor::set_vendor_matmul(true);
    decorated::<Parallel<Cuda>>(&device);
    decorated::<Parallel<FusedCuda>>(&device);
    let vendor_calls: u64 = kernel_paths()
        .into_iter()
        .filter(|&(op, path, _)| op == vendor::OP && path == KernelPath::Vendor)
        .map(|(_, _, count)| count)
        .sum();
    assert!(vendor_calls >= 2, "{vendor_calls} calls took cuBLASLt");
}

fn decorated<B: Backend>(device: &B::Device) {
    let case = CASES[4];
    let f32 = FloatDType::F32;
    let ([lhs_values, rhs_values], [lhs, rhs]) = case.operands::<B>(5, f32, device);
    let got = values_of(lhs.matmul(rhs));
    let (exact, magnitude) = exact(case, &lhs_values, &rhs_values, f32);
    let worst = worst_relative(&got, &exact, &magnitude);
    assert!(
        worst <= 1e-5,
        "{}: relative error {worst:e}",
        B::name(device)
    );
}
