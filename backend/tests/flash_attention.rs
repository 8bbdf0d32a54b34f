//! The CubeCL FlashAttention-2 kernels (`kernels::flash`) on wgpu (Mesa's lavapipe on CI), and
//! on CUDA too in a `--features cuda` build (`scripts/gpu-check.sh`): forward and all three
//! input gradients against decomposed attention with autodiff on Flex in f32, from the same
//! (rounded) inputs, causal and not, lengths 1, 17, 128 and 257 (the tile is 32 rows), head dims
//! 32, 64 and 128.
//!
//! Lavapipe ends an invocation's loops after 65535 iterations in all (see
//! `kernels::route::LOOP_ITERATION_CAP`); before the kernels unrolled their loops over a row's
//! columns, head dim 128 at length 257 passed it and gave wrong gradients. That case is tested
//! here, and length 600 (past it before, for the forward too) in its own test, as is the
//! kernels' declining a shape still past it on wgpu.
//!
//! Tolerances, on `max |kernel − reference| / max |reference|` per tensor:
//! - **f32**: 1e-5. Both compute in f32; they differ only in summation order.
//! - **f16**: 4u = 2e-3 with u = 2^-11 (f16's unit roundoff). The kernel computes in f32 and
//!   rounds once to f16 on output, an error of u relative to each element.
//! - **bf16**: 4u = 1.6e-2 with u = 2^-8. Vulkan has no bf16 arithmetic, so on lavapipe this
//!   case reports itself skipped; `scripts/gpu-check.sh` runs it on CUDA.
//!
//! Without a device a backend's cases report themselves skipped, unless `WILDFIRE_REQUIRE_WGPU=1`
//! (set by `.ci/run`) or `WILDFIRE_REQUIRE_CUDA=1` (set by `scripts/gpu-check.sh`) makes that a
//! failure.

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Distribution, FloatDType, Tensor, TensorData, TensorPrimitive};
use wildfire_backend::Parallel;
use wildfire_backend::kernels::attention::decomposed_attention;
use wildfire_backend::kernels::flash;
use wildfire_backend::kernels::route::{cube_runtime, kernels_enabled};

mod common;
use common::{KernelBackend, has_dtype, output_and_grads, relative_error};

type Reference = Autodiff<Flex>;

/// One case: the relative errors of the output, dQ, dK and dV.
fn errors<B: KernelBackend>(
    device: &B::Device,
    dtype: DType,
    seq: usize,
    d_head: usize,
    causal: bool,
) -> [f32; 4] {
    let shape = [1, 2, seq, d_head];
    let draw = |seed: u64| {
        Flex::seed(&Default::default(), seed);
        Tensor::<Flex, 4>::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
            .into_data()
            .convert_dtype(dtype)
    };
    let data: Vec<TensorData> = (0..4)
        .map(|i| draw(seq as u64 * 1000 + d_head as u64 + i))
        .collect();

    // Built in f32 and cast: `from_data` gives the backend's default float type.
    let primitive = |data: &TensorData| {
        Tensor::<B, 4>::from_data(data.clone(), device)
            .cast(FloatDType::from(dtype))
            .into_primitive()
            .tensor()
    };
    let read = |tensor: FloatTensor<B>| {
        Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(tensor)).into_data()
    };
    let (output, logsumexp) = flash::forward(
        primitive(&data[0]),
        primitive(&data[1]),
        primitive(&data[2]),
        causal,
    );
    let inputs = [&data[0], &data[1], &data[2]].map(primitive);
    let [query_grad, key_grad, value_grad] = flash::backward(
        [
            inputs[0].clone(),
            inputs[1].clone(),
            inputs[2].clone(),
            output.clone(),
            logsumexp,
            primitive(&data[3]),
        ],
        causal,
    );
    let kernel = [
        read(output),
        read(query_grad),
        read(key_grad),
        read(value_grad),
    ];

    let reference = output_and_grads::<Reference>(&data, &Default::default(), |q, k, v| {
        decomposed_attention(q, k, v, causal)
    });
    let mut errors = [0.0; 4];
    for (error, (actual, expected)) in errors.iter_mut().zip(kernel.into_iter().zip(reference)) {
        *error = relative_error(actual, expected);
    }
    errors
}

/// Every `(head dim, lengths)` and mask in `dtype` on backend `B`, each within `tolerance`.
fn check<B: KernelBackend>(dtype: DType, tolerance: f32, cases: &[(usize, &[usize])]) {
    let Some(device) = B::test_device() else {
        return;
    };
    let backend = B::name(&device);
    if !has_dtype::<B>(&device, dtype) {
        return;
    }
    let mut failures = Vec::new();
    for &(d_head, lengths) in cases {
        for &seq in lengths {
            for causal in [true, false] {
                let start = std::time::Instant::now();
                let errors = errors::<B>(&device, dtype, seq, d_head, causal);
                let case = format!(
                    "d_head {d_head} seq {seq} causal {causal}: O, dQ, dK, dV {}",
                    errors.map(|error| format!("{error:.1e}")).join(" ")
                );
                let seconds = start.elapsed().as_secs_f64();
                println!("{backend} {dtype:?} {case} ({seconds:.1} s)");
                if !errors.iter().all(|error| *error <= tolerance) {
                    failures.push(case);
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{backend} {dtype:?} beyond {tolerance:e}: {failures:?}"
    );
}

/// Every length at head dims 32, 64 and 128.
const CASES: [(usize, &[usize]); 3] = [
    (32, &[1, 17, 128, 257]),
    (64, &[1, 17, 128, 257]),
    (128, &[1, 17, 128, 257]),
];

#[test]
fn wgpu_tensors_route_to_the_cubecl_kernels_unless_opted_out() {
    assert_eq!(cube_runtime::<FloatTensor<Parallel<Wgpu>>>(), Some("wgpu"));
    assert_eq!(cube_runtime::<FloatTensor<Parallel<Flex>>>(), None);
    assert_eq!(
        kernels_enabled(),
        std::env::var("WILDFIRE_KERNELS").map_or(true, |v| v == "cubecl")
    );
}

#[test]
fn f32_kernels_match_decomposed_attention() {
    on_kernel_backends!(check(DType::F32, 1e-5, &CASES));
}

#[test]
fn f16_kernels_match_decomposed_attention() {
    on_kernel_backends!(check(DType::F16, 4.0 * 2f32.powi(-11), &CASES));
}

#[test]
fn bf16_kernels_match_decomposed_attention() {
    on_kernel_backends!(check(DType::BF16, 4.0 * 2f32.powi(-8), &CASES));
}

/// Length 600 at head dim 128: past lavapipe's loop cap before the loops over a row's columns
/// were unrolled (the forward was wrong too); now well inside it.
#[test]
fn head_dim_128_length_600() {
    on_kernel_backends!(check(DType::F32, 1e-5, &[(128, &[600])]));
}

/// On wgpu the kernels decline a shape whose loops would pass lavapipe's cap (the reference
/// runs instead), naming the shape.
#[test]
fn shapes_past_the_loop_cap_are_declined_on_wgpu() {
    let Some(device) = Wgpu::test_device() else {
        return;
    };
    let (seq, d_head) = (7000, 100);
    let query = Tensor::<Wgpu, 4>::zeros([1, 1, seq, d_head], &device)
        .into_primitive()
        .tensor();
    let reason = flash::unsupported(&[query.clone(), query.clone(), query]).expect("declined");
    assert!(
        reason.contains("length 7000")
            && reason.contains("head dim 100")
            && reason.contains("65535"),
        "{reason}"
    );
}
