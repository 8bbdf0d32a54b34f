//! The decorator's routing, end to end: fused attention under `Autodiff<Parallel<Wgpu>>` with the
//! CubeCL kernels opted in (`set_kernels_enabled`), and the matmul precision policy on
//! `Parallel<Flex>` (the reference) and `Parallel<Wgpu>` (the kernel).
//!
//! Both are process-wide settings, so one test sets them in order, in a process of its own.

use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, Flex, Wgpu};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, FloatDType, Tensor, TensorData};
use wildfire_backend::Parallel;
use wildfire_backend::kernels::attention::{decomposed_attention, fused_attention};
use wildfire_backend::kernels::matmul::{
    MatmulPrecision, MixedMatmul, reference, set_matmul_precision,
};
use wildfire_backend::kernels::route::{KernelPath, kernel_paths, set_kernels_enabled};

use crate::common::{KernelBackend, alone_in_a_process, output_and_grads, relative_error};

/// A `[rows, columns]` tensor of uniform values in [−2, 2) drawn on Flex.
fn uniform(shape: [usize; 2], seed: u64) -> TensorData {
    Flex::seed(&Default::default(), seed);
    Tensor::<Flex, 2>::random(shape, Distribution::Uniform(-2.0, 2.0), &Default::default())
        .into_data()
}

fn values(data: TensorData) -> Vec<f32> {
    data.convert::<f32>().to_vec().unwrap()
}

/// The calls `run` made of each op on each path, `(op, path, calls)`, from the process's kernel
/// counters: the proof that a kernel ran, which a result close to the reference's is not.
fn paths_taken<T>(run: impl FnOnce() -> T) -> (T, Vec<(&'static str, KernelPath, u64)>) {
    let before = kernel_paths();
    let result = run();
    let calls_before = |op: &str, path: KernelPath| {
        before
            .iter()
            .find(|&&(o, p, _)| o == op && p == path)
            .map_or(0, |&(_, _, calls)| calls)
    };
    let taken = kernel_paths()
        .into_iter()
        .map(|(op, path, calls)| (op, path, calls - calls_before(op, path)))
        .filter(|&(_, _, calls)| calls > 0)
        .collect();
    (result, taken)
}

#[test]
fn the_decorator_routes_attention_and_matmuls() {
    if !alone_in_a_process("routing::the_decorator_routes_attention_and_matmuls") {
        return;
    }
    set_kernels_enabled(true);
    if let Some(device) = Wgpu::test_device() {
        routed_attention_matches_decomposed(&device);
    }
    matmul_policy_on_flex();
    if let Some(device) = Wgpu::test_device() {
        matmul_policy_on_wgpu(&device);
    }
    set_matmul_precision(MatmulPrecision::Off);
}

/// The forward and the three gradients of `Autodiff<Parallel<Wgpu>>`'s fused attention (the
/// kernels and their autodiff node) against decomposed attention with autodiff on Flex.
/// Tolerance 1e-5 of the largest reference value, as for the kernels alone. The kernel counters
/// show the CubeCL kernels ran, once each: a reference that ran instead would pass the bound.
fn routed_attention_matches_decomposed(device: &WgpuDevice) {
    type Routed = Autodiff<Parallel<Wgpu>>;
    type Reference = Autodiff<Flex>;
    let shape = [1, 2, 128, 64];
    let data: Vec<TensorData> = (0..4)
        .map(|seed| {
            Flex::seed(&Default::default(), seed);
            Tensor::<Flex, 4>::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
                .into_data()
        })
        .collect();
    for causal in [true, false] {
        let (routed, taken) = paths_taken(|| {
            output_and_grads::<Routed>(&data, device, |q, k, v| fused_attention(q, k, v, causal))
        });
        assert_eq!(
            taken,
            [
                ("attention backward", KernelPath::CubeCl, 1),
                ("attention forward", KernelPath::CubeCl, 1)
            ],
            "causal {causal}: the kernels, once each"
        );
        let expected = output_and_grads::<Reference>(&data, &Default::default(), |q, k, v| {
            decomposed_attention(q, k, v, causal)
        });
        for (name, (actual, expected)) in ["O", "dQ", "dK", "dV"]
            .iter()
            .zip(routed.into_iter().zip(expected))
        {
            let error = relative_error(actual, expected);
            println!("routed attention causal {causal}: {name} relative error {error:.1e}");
            assert!(
                error <= 1e-5,
                "{name} causal {causal}: relative error {error:e}"
            );
        }
    }
}

/// On `Parallel<Flex>`: off is the backend's own matmul, bit for bit; bf16 is the reference
/// mixed-precision matmul (inputs rounded to bf16), bit for bit, and differs from f32, also in
/// a linear layer; and the backward's matmuls under `Autodiff<Parallel<Flex>>` take the policy
/// too.
fn matmul_policy_on_flex() {
    let device = Default::default();
    let [x, w] = [uniform([8, 48], 1), uniform([48, 16], 2)];
    let plain = Tensor::<Flex, 2>::from_data(x.clone(), &device)
        .matmul(Tensor::from_data(w.clone(), &device))
        .into_data();
    let decorated = || {
        Tensor::<Parallel<Flex>, 2>::from_data(x.clone(), &device)
            .matmul(Tensor::from_data(w.clone(), &device))
            .into_data()
    };

    set_matmul_precision(MatmulPrecision::Off);
    assert_eq!(values(decorated()), values(plain.clone()), "policy off");

    set_matmul_precision(MatmulPrecision::Bf16);
    let spec = MixedMatmul {
        compute: FloatDType::BF16,
        output: FloatDType::F32,
        gelu: false,
    };
    let expected = reference(
        Tensor::<Flex, 2>::from_data(x.clone(), &device),
        Tensor::from_data(w.clone(), &device),
        None,
        spec,
    );
    assert_eq!(
        values(decorated()),
        values(expected.to_data()),
        "policy bf16"
    );
    assert_ne!(
        values(decorated()),
        values(plain),
        "bf16 rounding changes the product"
    );
    // A linear layer (Burn's `module::linear`, what `nn::Linear` runs) multiplies through the
    // decorator's matmul, so it takes the policy as well.
    let linear = burn::tensor::module::linear(
        Tensor::<Parallel<Flex>, 2>::from_data(x.clone(), &device),
        Tensor::from_data(w.clone(), &device),
        None,
    );
    assert_eq!(
        values(linear.into_data()),
        values(expected.into_data()),
        "a linear layer under bf16"
    );

    // d(Σ x·w)/dx = 1·wᵀ, itself a matmul the policy rounds.
    let leaf = Tensor::<Autodiff<Parallel<Flex>>, 2>::from_data(x, &device).require_grad();
    let product = leaf.clone().matmul(Tensor::from_data(w.clone(), &device));
    let grads = product.sum().backward();
    let expected_grad = reference(
        Tensor::<Flex, 2>::ones([8, 16], &device),
        Tensor::<Flex, 2>::from_data(w, &device).transpose(),
        None,
        spec,
    );
    assert_eq!(
        values(leaf.grad(&grads).unwrap().into_data()),
        values(expected_grad.into_data()),
        "the backward's matmul under bf16"
    );
}

/// On `Parallel<Wgpu>` with the kernels opted in, f16: the kernel's product equals
/// `Parallel<Flex>`'s (the reference) under the same policy, up to the order of the f32 sums,
/// `|Δ| ≤ 2γ·Σ|aₗbₗ|` with `γ = 1.01·k·2⁻²⁴`. A product from unrounded inputs would differ by
/// about 2⁻¹¹·Σ|aₗbₗ|, far beyond that. The kernel counters show the CubeCL kernel ran.
fn matmul_policy_on_wgpu(device: &WgpuDevice) {
    let (k, n) = (64, 24);
    let [x, w] = [uniform([16, k], 3), uniform([k, n], 4)];
    set_matmul_precision(MatmulPrecision::F16);
    let (on_wgpu, taken) = paths_taken(|| {
        Tensor::<Parallel<Wgpu>, 2>::from_data(x.clone(), device)
            .matmul(Tensor::from_data(w.clone(), device))
            .into_data()
    });
    assert_eq!(
        taken,
        [("mixed-precision matmul", KernelPath::CubeCl, 1)],
        "the kernel, once"
    );
    let on_flex = Tensor::<Parallel<Flex>, 2>::from_data(x.clone(), &Default::default())
        .matmul(Tensor::from_data(w.clone(), &Default::default()))
        .into_data();
    let (x, w) = (values(x), values(w));
    let gamma = 1.01 * k as f32 * 2f32.powi(-24);
    let (on_wgpu, on_flex) = (values(on_wgpu), values(on_flex));
    assert_eq!(on_wgpu.len(), on_flex.len(), "element counts");
    for (index, (a, b)) in on_wgpu.iter().zip(on_flex).enumerate() {
        let (i, j) = (index / n, index % n);
        let magnitude: f32 = (0..k).map(|l| (x[i * k + l] * w[l * n + j]).abs()).sum();
        assert!(
            (a - b).abs() <= 2.0 * gamma * magnitude,
            "element ({i}, {j}): wgpu {a} against the reference {b}"
        );
    }
}
