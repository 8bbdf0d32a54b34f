//! What the kernel tests share: the kernel backends (wgpu, and CUDA with `--features cuda`) and
//! their devices (or a printed skip without one), the output and input gradients of an
//! attention, the error measures, deterministic test data, rounding to a half type, GPT-2's
//! GELU in f64, and a process of its own for a test that changes a process-wide setting.
#![allow(dead_code)]

use std::process::Command;

use burn::backend::Wgpu;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use wildfire_backend::compare::relative_difference;
use wildfire_backend::kernels::probe;

/// A backend the CubeCL kernels run on, its tensors being the runtime's.
pub trait KernelBackend: Backend<FloatTensorPrimitive = CubeTensor<Self::Runtime>> {
    type Runtime: CubeRuntime;
    /// The unit roundoff of what an f32 matmul may round its inputs to: TF32's 2⁻¹¹ where
    /// Burn's matmul may use TF32 tensor cores (CUDA), 0 elsewhere.
    const F32_MATMUL_INPUT_ROUNDOFF: f64;
    /// The variable that makes a missing device a failure rather than a skip ([`probe::for_test`]).
    const REQUIRE_ENV: &'static str;
    /// The dtypes whose arithmetic the device must have where [`Self::REQUIRE_ENV`] is set: a
    /// missing one fails [`has_dtype`] there instead of skipping.
    const REQUIRED_DTYPES: &'static [DType];
    /// The device, or `None` (printed as a skip) when there is none; see [`probe::for_test`].
    fn test_device() -> Option<Self::Device> {
        probe::for_test(Self::probe(), Self::REQUIRE_ENV)
    }
    /// The device, or why there is none.
    fn probe() -> Result<Self::Device, String>;
}

/// Whether [`KernelBackend::REQUIRE_ENV`] is set to 1 for `B`.
fn required<B: KernelBackend>() -> bool {
    std::env::var(B::REQUIRE_ENV).is_ok_and(|v| v == "1")
}

/// `.ci/run` sets `WILDFIRE_REQUIRE_WGPU=1`: CI has lavapipe, so a missing adapter fails, and so
/// does one without f16 (lavapipe has it; WGSL has no bf16, so bf16 is skipped on every wgpu
/// device).
impl KernelBackend for Wgpu {
    type Runtime = cubecl::wgpu::WgpuRuntime;
    const F32_MATMUL_INPUT_ROUNDOFF: f64 = 0.0;
    const REQUIRE_ENV: &'static str = "WILDFIRE_REQUIRE_WGPU";
    const REQUIRED_DTYPES: &'static [DType] = &[DType::F32, DType::F16];
    fn probe() -> Result<Self::Device, String> {
        probe::wgpu()
    }
}

/// `scripts/gpu-check.sh` sets `WILDFIRE_REQUIRE_CUDA=1`: it has seen the GPU first (an H100 or
/// H200, which compute in f16 and bf16).
#[cfg(feature = "cuda")]
impl KernelBackend for burn::backend::Cuda {
    type Runtime = cubecl::cuda::CudaRuntime;
    const F32_MATMUL_INPUT_ROUNDOFF: f64 = 1.0 / 2048.0;
    const REQUIRE_ENV: &'static str = "WILDFIRE_REQUIRE_CUDA";
    const REQUIRED_DTYPES: &'static [DType] = &[DType::F32, DType::F16, DType::BF16];
    fn probe() -> Result<Self::Device, String> {
        probe::cuda()
    }
}

/// `$check::<B>($args…)` on every kernel backend this build has: `Wgpu`, and `Cuda` with
/// `--features cuda`.
macro_rules! on_kernel_backends {
    ($check:ident($($arg:expr),* $(,)?)) => {{
        $check::<burn::backend::Wgpu>($($arg),*);
        #[cfg(feature = "cuda")]
        $check::<burn::backend::Cuda>($($arg),*);
    }};
}

/// Whether `device` computes in `dtype`; prints a skip when it does not, and fails instead where
/// the backend's tests are required and `dtype` is one of its
/// [`REQUIRED_DTYPES`](KernelBackend::REQUIRED_DTYPES).
pub fn has_dtype<B: KernelBackend>(device: &B::Device, dtype: DType) -> bool {
    let has = B::supports_dtype(device, dtype);
    if !has {
        let missing = format!("{} has no {dtype:?} arithmetic", B::name(device));
        assert!(
            !(required::<B>() && B::REQUIRED_DTYPES.contains(&dtype)),
            "{}=1 but {missing}",
            B::REQUIRE_ENV
        );
        eprintln!("skipped: {missing}");
    }
    has
}

/// The output and the gradients of query, key and value (in that order) of `attend` on backend
/// `A`, from `data = [query, key, value, output gradient]` (converted to f32).
pub fn output_and_grads<A: AutodiffBackend>(
    data: &[TensorData],
    device: &A::Device,
    attend: impl Fn(Tensor<A, 4>, Tensor<A, 4>, Tensor<A, 4>) -> Tensor<A, 4>,
) -> [TensorData; 4] {
    let tensor =
        |i: usize| Tensor::<A, 4>::from_data(data[i].clone().convert_dtype(DType::F32), device);
    let [q, k, v] = [0, 1, 2].map(|i| tensor(i).require_grad());
    let output = attend(q.clone(), k.clone(), v.clone());
    let grads = (output.clone() * tensor(3)).sum().backward();
    [
        output.into_data(),
        q.grad(&grads).unwrap().into_data(),
        k.grad(&grads).unwrap().into_data(),
        v.grad(&grads).unwrap().into_data(),
    ]
}

/// `max |actual − expected| / max |expected|`: NaN when any value is NaN; differing lengths
/// panic ([`wildfire_backend::compare`]).
pub fn relative_error(actual: TensorData, expected: TensorData) -> f32 {
    let actual: Vec<f32> = actual.convert::<f32>().to_vec().unwrap();
    let expected: Vec<f32> = expected.convert::<f32>().to_vec().unwrap();
    relative_difference(&actual, &expected) as f32
}

/// A deterministic stream of `count` values in [0, 1) (xorshift), from `seed`.
pub fn uniform(count: usize, seed: u64) -> impl Iterator<Item = f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..count).map(move |_| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    })
}

/// A deterministic stream of `count` values in [−bound, bound).
pub fn signed_values(count: usize, seed: u64, bound: f32) -> Vec<f32> {
    uniform(count, seed)
        .map(|unit| (unit * 2.0 - 1.0) * bound)
        .collect()
}

/// `got` against `exact` elementwise, allowing `scale` times the bound of an elementwise
/// exp-and-quotient evaluated in f32, `2⁻¹⁷(1 + |e|)`, plus `roundoff·|e|` (the output type's
/// rounding); the failures, described.
pub fn compare_to_f64(
    what: &str,
    got: TensorData,
    exact: &[f64],
    roundoff: f64,
    scale: f64,
) -> Vec<String> {
    let got: Vec<f32> = got.convert::<f32>().to_vec().unwrap();
    assert_eq!(got.len(), exact.len(), "{what}: length");
    got.iter()
        .zip(exact)
        .enumerate()
        .filter_map(|(i, (&g, &e))| {
            let bound = scale * 2f64.powi(-17) * (1.0 + e.abs()) + roundoff * e.abs();
            let error = (f64::from(g) - e).abs();
            // A NaN error fails too.
            let within = error <= bound;
            (!within).then(|| format!("{what}[{i}]: {g} for {e} (bound {bound:.1e})"))
        })
        .take(5)
        .collect()
}

/// `values` as a tensor of `shape` on `device`.
pub fn tensor_of<B: Backend, const D: usize>(
    values: &[f32],
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(values.to_vec(), shape), device)
}

/// `x` rounded to `dtype`, as f64.
pub fn rounded(x: f32, dtype: FloatDType) -> f64 {
    match dtype {
        FloatDType::F16 => half::f16::from_f32(x).to_f64(),
        FloatDType::BF16 => half::bf16::from_f32(x).to_f64(),
        _ => f64::from(x),
    }
}

/// The unit roundoff of `dtype` (0 for f32, the reference's own type).
pub fn unit_roundoff(dtype: FloatDType) -> f64 {
    match dtype {
        FloatDType::F16 => 2f64.powi(-11),
        FloatDType::BF16 => 2f64.powi(-8),
        _ => 0.0,
    }
}

/// `√(2/π)` and the cubic coefficient of GPT-2's GELU.
pub const GELU_C: f64 = 0.797_884_560_802_865_4;
pub const GELU_A: f64 = 0.044715;

/// GPT-2's GELU, `½z(1 + tanh(c(z + a·z³)))`, in f64.
pub fn gelu(z: f64) -> f64 {
    0.5 * z * (1.0 + (GELU_C * (z + GELU_A * z * z * z)).tanh())
}

/// Runs the test named `name` (as the test harness names it, `module::function`) alone in a new
/// process of this test binary, for a test that changes a process-wide setting the other tests
/// of the binary would see. Returns `true` in that process, which then runs the test's body, and
/// `false` in the calling one, once the new process has passed.
pub fn alone_in_a_process(name: &str) -> bool {
    const ALONE: &str = "WILDFIRE_TEST_ALONE";
    if std::env::var(ALONE).as_deref() == Ok(name) {
        return true;
    }
    let binary = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(binary)
        .args([name, "--exact", "--nocapture", "--test-threads", "1"])
        .env(ALONE, name)
        .output()
        .expect("run the test binary");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    print!("{text}");
    assert!(
        out.status.success(),
        "{name}, in a process of its own, failed"
    );
    assert!(
        text.contains("1 passed"),
        "{name}: the test binary ran no test of that name"
    );
    false
}

/// [`relative_error`] is NaN (so beyond every `<=` bound) when any value is NaN, and refuses values
/// of different lengths.
#[test]
fn relative_error_fails_a_nan_and_refuses_a_short_result() {
    let data = |values: &[f32]| TensorData::new(values.to_vec(), [values.len()]);
    let good = data(&[1.0, -2.0, 4.0]);
    assert_eq!(relative_error(data(&[1.0, -2.0, 3.0]), good.clone()), 0.25);
    let nan = data(&[1.0, f32::NAN, 4.0]);
    assert!(relative_error(nan.clone(), good.clone()).is_nan());
    assert!(relative_error(good.clone(), nan).is_nan());
    let compare_short = || relative_error(data(&[1.0, -2.0]), good);
    let short = std::panic::catch_unwind(std::panic::AssertUnwindSafe(compare_short));
    assert!(short.is_err(), "a short result was compared as a prefix");
}
