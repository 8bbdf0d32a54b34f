//! The fused AdamW (`kernels::adamw`) on the kernel backends against Burn's AdamW: 50 steps of
//! a `[67, 129]` parameter (no multiple of a workgroup) with a new gradient and learning rate
//! each step, with and without weight decay, the CubeCL kernel launched at once (Burn's bare
//! `Wgpu`; `Cuda` in a `--features cuda` build) and queued in Burn's fusion stream
//! (`FusedWgpu`, what `--device wgpu` trains on).
//!
//! Burn's step is a dozen kernels, each rounding to f32; the fused one runs the same f32
//! operations in one kernel, where a GPU compiler may contract a product and a sum into one
//! fused multiply-add and WGSL allows `√` and `/` a few ulps of error. So the two agree within
//! a bound, not bitwise: after 50 steps every element of the parameter and of both moments is
//! within 1e-5 of the tensor's largest magnitude (lavapipe: measured 0, the same bits; the
//! bound leaves room for a GPU's contractions, a few ulps a step). A NaN anywhere fails.

use burn::optim::{AdamWConfig, AdamWState, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use wildfire_backend::device::FusedWgpu;
use wildfire_backend::kernels::adamw::FusedAdamW;
use wildfire_backend::kernels::route::{KernelPath, kernel_paths};

use crate::common::{KernelBackend, signed_values, tensor_of};

const SHAPE: [usize; 2] = [67, 129];
const STEPS: usize = 50;
/// Every element within this fraction of the largest magnitude of Burn's result after
/// [`STEPS`] steps. Measured on lavapipe (2026-12-07): 0, the kernel doing Burn's operations in
/// Burn's order. Not derived from a measurement: the room is for a GPU compiler that contracts
/// multiply-adds (a rounding fewer each), not yet measured on CUDA.
const BOUND: f32 = 1e-5;

/// The parameter and both moments after [`STEPS`] steps of `optimizer` from a fixed start.
fn trained<B: Backend, O: SimpleOptimizer<B, State<2> = AdamWState<B, 2>>>(
    optimizer: &O,
    device: &B::Device,
) -> [TensorData; 3] {
    let count = SHAPE[0] * SHAPE[1];
    let mut param = tensor_of::<B, 2>(&signed_values(count, 3, 1.0), SHAPE, device);
    let mut state = None;
    for step in 0..STEPS {
        let grad = tensor_of::<B, 2>(&signed_values(count, 100 + step as u64, 2.0), SHAPE, device);
        let lr = 1e-2 * (1.0 + step as f64 / 10.0);
        (param, state) = optimizer.step(lr, param, grad, state);
    }
    let momentum = state.expect("a state after a step").momentum;
    [param, momentum.moment_1, momentum.moment_2].map(Tensor::into_data)
}

/// Every element of `got` within [`BOUND`] of `expected`'s largest magnitude (NaN fails).
fn assert_close(got: &TensorData, expected: &TensorData, what: &str) {
    let got: Vec<f32> = got.to_vec().unwrap();
    let expected: Vec<f32> = expected.to_vec().unwrap();
    assert_eq!(got.len(), expected.len(), "{what}: lengths");
    let scale = expected.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let far: Vec<(usize, f32, f32)> = (got.iter().zip(&expected).enumerate())
        .filter(|(_, (g, e))| !within((*g - *e).abs(), BOUND * scale))
        .map(|(i, (g, e))| (i, *g, *e))
        .take(5)
        .collect();
    assert!(
        far.is_empty(),
        "{what}: (index, fused, Burn's) beyond {BOUND} of {scale}: {far:?}"
    );
    let worst = (got.iter().zip(&expected)).fold(0.0f32, |m, (g, e)| m.max((g - e).abs()));
    println!(
        "{what}: largest difference {:.1e} of the largest magnitude",
        worst / scale
    );
}

/// Whether `difference` is at most `bound` (a NaN is not).
fn within(difference: f32, bound: f32) -> bool {
    difference <= bound
}

/// The calls of the AdamW kernel on `path` so far in this process.
fn kernel_calls(path: KernelPath) -> u64 {
    kernel_paths()
        .into_iter()
        .filter(|&(op, taken, _)| op == "adamw" && taken == path)
        .map(|(_, _, count)| count)
        .sum()
}

/// Fused against Burn's AdamW on `B`, the kernel counted on `path` for every step after the
/// first (which creates the moments with Burn's step).
fn matches_burn<B: Backend>(device: &B::Device, path: KernelPath, name: &str) {
    for weight_decay in [0.0, 0.1] {
        let fused = FusedAdamW::new(0.9, 0.95, 1e-8, weight_decay).with_fused(true);
        let burn = AdamWConfig::new()
            .with_beta_1(0.9)
            .with_beta_2(0.95)
            .with_epsilon(1e-8)
            .with_weight_decay(weight_decay)
            .build();
        let before = kernel_calls(path);
        let got = trained::<B, _>(&fused, device);
        assert!(
            kernel_calls(path) >= before + (STEPS - 1) as u64,
            "{name}: the AdamW kernel did not run on {path}"
        );
        let expected = trained::<B, _>(&burn, device);
        for (i, what) in ["parameter", "first moment", "second moment"]
            .iter()
            .enumerate()
        {
            let what = format!("{name}, weight decay {weight_decay}: {what}");
            assert_close(&got[i], &expected[i], &what);
        }
    }
}

fn kernel_matches_burn<B: KernelBackend>() {
    let Some(device) = B::test_device() else {
        return;
    };
    matches_burn::<B>(&device, KernelPath::CubeCl, "the kernel launched at once");
}

#[test]
fn the_fused_step_follows_burns_adamw() {
    on_kernel_backends!(kernel_matches_burn());
    if let Some(device) = <burn::backend::Wgpu as KernelBackend>::test_device() {
        matches_burn::<FusedWgpu>(
            &device,
            KernelPath::CubeClFused,
            "the kernel in the fusion stream",
        );
    }
}
