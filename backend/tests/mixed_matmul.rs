//! The mixed-precision matmul (`kernels::matmul`): its reference on Flex and its CubeCL kernel on
//! wgpu (Mesa's lavapipe on CI), and on CUDA too in a `--features cuda` build
//! (`scripts/gpu-check.sh`), against an f64 computation from the same rounded inputs.
//!
//! - **Random data** (uniform in [−2, 2)): `|out − exact| ≤ γ·Σₗ|aₗbₗ| + u_out·|exact|`, with
//!   `γ = 1.01·k·2⁻²³` bounding f32 summation of `k` exact products (the inputs are rounded to
//!   the compute type first, and a product of two such values is exact in f32) and `u_out` the
//!   output type's unit roundoff (0 for f32). 2⁻²³ rather than round-to-nearest's 2⁻²⁴ admits
//!   accumulators that truncate, as tensor cores' may. Under GELU (slope at most 1.13) the bound
//!   is multiplied by 1.13 and 2⁻²⁰·(|x| + 1) added for evaluating it in f32. Skipping the
//!   rounding to f16 would be off by about 2⁻¹¹·Σ|aₗbₗ|, over 10× this bound at k ≤ 128.
//!   With f32 compute on CUDA the matmul may run on TF32 tensor cores (as Burn's own does),
//!   whose input rounding (2⁻¹¹ each) adds `2⁻¹⁰·Σₗ|aₗbₗ|` there.
//! - **Small integers** (entries in [−2, 2], bias in [−8, 8]): every product and partial sum is
//!   an integer, exact in f32, and every result (checked to be at most 2⁸ in magnitude) is exact
//!   in f16 and bf16 too, so the result must equal the f64 one bitwise, in f32 and in the
//!   compute type.
//!
//! bf16 has no WGSL type, so on lavapipe the bf16 kernel cases report themselves skipped.
//! Without a device a backend's cases report themselves skipped, unless `WILDFIRE_REQUIRE_WGPU=1`
//! (`.ci/run`) or `WILDFIRE_REQUIRE_CUDA=1` (`scripts/gpu-check.sh`) makes that a failure.

use burn::backend::{Flex, Wgpu};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData, TensorPrimitive};
use wildfire_backend::compare::{assert_same_length, nan_max, within};
use wildfire_backend::kernels::matmul::{self, MixedMatmul, mixed_matmul};

use crate::common::{KernelBackend, gelu, has_dtype, rounded, uniform, unit_roundoff};

/// `[lhs batch, m, k] × [rhs batch, k, n]`; a batch of 1 broadcasts.
#[derive(Clone, Copy, Debug)]
struct Case {
    lhs_batch: usize,
    rhs_batch: usize,
    m: usize,
    k: usize,
    n: usize,
}

/// Odd sizes, batch broadcasting both ways, and one case past 64 rows and 128 columns, so that
/// the matmul's tiles have partial edges.
const CASES: [Case; 5] = [
    case(2, 2, 1, 1, 1),
    case(3, 3, 17, 33, 9),
    case(1, 3, 20, 64, 40),
    case(2, 1, 33, 128, 48),
    case(1, 1, 70, 16, 130),
];

const fn case(lhs_batch: usize, rhs_batch: usize, m: usize, k: usize, n: usize) -> Case {
    Case {
        lhs_batch,
        rhs_batch,
        m,
        k,
        n,
    }
}

impl Case {
    fn batches(&self) -> usize {
        self.lhs_batch.max(self.rhs_batch)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Data {
    Random,
    SmallIntegers,
}

/// A deterministic stream of `count` values (xorshift).
fn values(count: usize, seed: u64, data: Data, bound: f32) -> Vec<f32> {
    uniform(count, seed)
        .map(|unit| match data {
            Data::Random => (unit * 2.0 - 1.0) * bound,
            Data::SmallIntegers => ((unit * (2.0 * bound + 1.0)).floor() - bound).max(-bound),
        })
        .collect()
}

struct Operands {
    lhs: Vec<f32>,
    rhs: Vec<f32>,
    bias: Option<Vec<f32>>,
}

impl Operands {
    fn new(case: Case, data: Data, with_bias: bool, seed: u64) -> Self {
        let lhs = values(case.lhs_batch * case.m * case.k, seed, data, 2.0);
        let rhs = values(case.rhs_batch * case.k * case.n, seed + 1, data, 2.0);
        let bias = with_bias.then(|| values(case.n, seed + 2, data, 8.0));
        Self { lhs, rhs, bias }
    }

    /// The exact result from the rounded inputs and `Σₗ|aₗbₗ|`, per output element, in f64.
    fn exact(&self, case: Case, spec: MixedMatmul) -> (Vec<f64>, Vec<f64>) {
        let r = |x: f32| rounded(x, spec.compute);
        let (mut exact, mut magnitude) = (Vec::new(), Vec::new());
        for b in 0..case.batches() {
            let lhs_start = if case.lhs_batch == 1 {
                0
            } else {
                b * case.m * case.k
            };
            let rhs_start = if case.rhs_batch == 1 {
                0
            } else {
                b * case.k * case.n
            };
            for i in 0..case.m {
                for j in 0..case.n {
                    let products = (0..case.k).map(|l| {
                        r(self.lhs[lhs_start + i * case.k + l])
                            * r(self.rhs[rhs_start + l * case.n + j])
                    });
                    let (sum, size) = products.fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()));
                    let biased = sum + self.bias.as_ref().map_or(0.0, |bias| f64::from(bias[j]));
                    exact.push(if spec.gelu { gelu(biased) } else { biased });
                    magnitude.push(size);
                }
            }
        }
        (exact, magnitude)
    }

    fn tensors<B: Backend>(
        &self,
        case: Case,
        device: &B::Device,
    ) -> (Tensor<B, 3>, Tensor<B, 3>, Option<Tensor<B, 1>>) {
        let tensor = |values: &[f32], shape: [usize; 3]| {
            Tensor::<B, 3>::from_data(TensorData::new(values.to_vec(), shape), device)
        };
        (
            tensor(&self.lhs, [case.lhs_batch, case.m, case.k]),
            tensor(&self.rhs, [case.rhs_batch, case.k, case.n]),
            self.bias
                .as_ref()
                .map(|bias| Tensor::from_data(TensorData::new(bias.clone(), [case.n]), device)),
        )
    }
}

/// A mixed-precision matmul on one backend.
type Matmul<B> = fn(Tensor<B, 3>, Tensor<B, 3>, Option<Tensor<B, 1>>, MixedMatmul) -> Tensor<B, 3>;

/// Every case, epilogue and output type for `compute` on `data`; the failures, described.
/// `f32_input_roundoff` is what the matmul may round f32 inputs to (TF32's 2⁻¹¹ on CUDA).
fn failures<B: Backend>(
    device: &B::Device,
    matmul: Matmul<B>,
    compute: FloatDType,
    data: Data,
    f32_input_roundoff: f64,
) -> Vec<String> {
    let mut failures = Vec::new();
    for (index, &case) in CASES.iter().enumerate() {
        for (with_bias, gelu) in [(false, false), (true, false), (true, true), (false, true)] {
            // GELU's values are not integers.
            if gelu && data == Data::SmallIntegers {
                continue;
            }
            for output in [FloatDType::F32, compute] {
                let spec = MixedMatmul {
                    compute,
                    output,
                    gelu,
                };
                let operands = Operands::new(case, data, with_bias, index as u64 * 10 + 7);
                let (lhs, rhs, bias) = operands.tensors::<B>(case, device);
                let out = matmul(lhs, rhs, bias, spec);
                assert_eq!(out.dtype(), DType::from(output), "{case:?} {spec:?}");
                let actual: Vec<f64> = out.into_data().convert::<f64>().to_vec().unwrap();
                let (exact, magnitude) = operands.exact(case, spec);
                if data == Data::SmallIntegers {
                    // The premise of bitwise equality: every value is exact in every type used.
                    assert!(
                        exact.iter().all(|x| x.abs() <= 256.0),
                        "{case:?}: a sum past 2⁸"
                    );
                }
                let input_roundoff = match compute {
                    FloatDType::F32 => f32_input_roundoff,
                    _ => 0.0,
                };
                let bound = Bound {
                    k: case.k,
                    spec,
                    data,
                    input_roundoff,
                };
                let worst = bound.worst_excess(&actual, &exact, &magnitude);
                // A NaN excess fails too.
                if !within(worst, 0.0) {
                    failures.push(format!(
                        "{case:?} {spec:?} bias {with_bias}: beyond the bound by {worst:e}"
                    ));
                }
            }
        }
    }
    failures
}

/// What an element's error may be (see the module doc).
struct Bound {
    k: usize,
    spec: MixedMatmul,
    data: Data,
    /// The unit roundoff of a rounding the matmul applies to its inputs (0 for none).
    input_roundoff: f64,
}

impl Bound {
    /// The bound on `|actual − exact|` for an element with `Σₗ|aₗbₗ| = magnitude`.
    fn of(&self, exact: f64, magnitude: f64) -> f64 {
        let product =
            (1.01 * self.k as f64 * 2f64.powi(-23) + 2.0 * self.input_roundoff) * magnitude;
        let output_rounding = unit_roundoff(self.spec.output) * exact.abs();
        match self.data {
            Data::SmallIntegers => 0.0,
            Data::Random if self.spec.gelu => {
                1.13 * product + 2f64.powi(-20) * (exact.abs() + 1.0) + output_rounding
            }
            Data::Random => product + output_rounding,
        }
    }

    /// The largest amount by which an element misses its bound (0 when none does).
    fn worst_excess(&self, actual: &[f64], exact: &[f64], magnitude: &[f64]) -> f64 {
        assert_same_length(actual.len(), exact.len());
        nan_max(
            (actual.iter().zip(exact).zip(magnitude))
                .map(|((a, e), m)| (a - e).abs() - self.of(*e, *m)),
        )
    }
}

fn on_flex(
    lhs: Tensor<Flex, 3>,
    rhs: Tensor<Flex, 3>,
    bias: Option<Tensor<Flex, 1>>,
    spec: MixedMatmul,
) -> Tensor<Flex, 3> {
    mixed_matmul(lhs, rhs, bias, spec)
}

/// The kernel itself, not the router (which would fall back to the reference if the kernel
/// declined).
fn kernel_only<B: KernelBackend>(
    lhs: Tensor<B, 3>,
    rhs: Tensor<B, 3>,
    bias: Option<Tensor<B, 1>>,
    spec: MixedMatmul,
) -> Tensor<B, 3> {
    let out = matmul::kernel(
        lhs.into_primitive().tensor(),
        rhs.into_primitive().tensor(),
        bias.map(|bias| bias.into_primitive().tensor()),
        spec,
    )
    .unwrap_or_else(|reason| panic!("the kernel declined {spec:?}: {reason}"));
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

fn check_flex(compute: FloatDType, data: Data) {
    let failures = failures::<Flex>(&Default::default(), on_flex, compute, data, 0.0);
    assert!(failures.is_empty(), "{failures:#?}");
}

fn check_kernel<B: KernelBackend>(compute: FloatDType, data: Data) {
    let Some(device) = B::test_device() else {
        return;
    };
    if !has_dtype::<B>(&device, compute.into()) {
        return;
    }
    let failures = failures::<B>(
        &device,
        kernel_only::<B>,
        compute,
        data,
        B::F32_MATMUL_INPUT_ROUNDOFF,
    );
    assert!(failures.is_empty(), "{}: {failures:#?}", B::name(&device));
}

#[test]
fn reference_matches_f64_on_random_data() {
    for compute in [FloatDType::F16, FloatDType::BF16, FloatDType::F32] {
        check_flex(compute, Data::Random);
    }
}

#[test]
fn reference_is_exact_on_small_integers() {
    for compute in [FloatDType::F16, FloatDType::BF16] {
        check_flex(compute, Data::SmallIntegers);
    }
}

#[test]
fn f16_kernel_matches_f64_on_random_data() {
    on_kernel_backends!(check_kernel(FloatDType::F16, Data::Random));
}

#[test]
fn f16_kernel_is_exact_on_small_integers() {
    on_kernel_backends!(check_kernel(FloatDType::F16, Data::SmallIntegers));
}

#[test]
fn f32_kernel_matches_f64_on_random_data() {
    on_kernel_backends!(check_kernel(FloatDType::F32, Data::Random));
}

#[test]
fn bf16_kernel_matches_f64() {
    on_kernel_backends!(check_kernel(FloatDType::BF16, Data::Random));
    on_kernel_backends!(check_kernel(FloatDType::BF16, Data::SmallIntegers));
}

/// What the kernel does not take it declines with the values named, and the routed op then
/// runs the reference.
#[test]
fn the_kernel_declines_mismatched_batches_and_the_reference_runs() {
    let Some(device) = Wgpu::test_device() else {
        return;
    };
    let spec = MixedMatmul {
        compute: FloatDType::F32,
        output: FloatDType::F32,
        gelu: false,
    };
    let lhs = Tensor::<Wgpu, 3>::ones([2, 3, 4], &device);
    let rhs = Tensor::<Wgpu, 3>::ones([3, 4, 5], &device);
    let reason = matmul::kernel(
        lhs.clone().into_primitive().tensor(),
        rhs.into_primitive().tensor(),
        None,
        spec,
    )
    .unwrap_err();
    assert!(
        reason.contains("[2, 3, 4]") && reason.contains("[3, 4, 5]"),
        "{reason}"
    );

    let rhs = Tensor::<Wgpu, 3>::ones([1, 4, 5], &device);
    let bias = Tensor::<Wgpu, 1>::ones([4], &device);
    let reason = matmul::kernel(
        lhs.into_primitive().tensor(),
        rhs.into_primitive().tensor(),
        Some(bias.into_primitive().tensor()),
        spec,
    )
    .unwrap_err();
    assert!(
        reason.contains("bias") && reason.contains("5 columns"),
        "{reason}"
    );
}

/// The bound's check fails on a NaN element (an excess of NaN is never within 0) and refuses a
/// result shorter than the exact one.
#[test]
fn the_bound_fails_a_nan_and_refuses_a_short_result() {
    let bound = Bound {
        k: 4,
        spec: MixedMatmul {
            compute: FloatDType::F32,
            output: FloatDType::F32,
            gelu: false,
        },
        data: Data::Random,
        input_roundoff: 0.0,
    };
    let (exact, magnitude) = ([1.0, 2.0, 3.0], [4.0, 4.0, 4.0]);
    assert!(within(bound.worst_excess(&exact, &exact, &magnitude), 0.0));
    let excess = bound.worst_excess(&[1.0, f64::NAN, 3.0], &exact, &magnitude);
    assert!(!within(excess, 0.0), "a NaN element scored {excess}");
    let short = std::panic::catch_unwind(|| bound.worst_excess(&[1.0, 2.0], &exact, &magnitude));
    assert!(short.is_err(), "a short result was compared as a prefix");
}
