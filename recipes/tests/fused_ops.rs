//! The GPT and the Llama model with their fused ops (FlashAttention-2's forward and its fused
//! backward, `wildfire_backend::kernels::attention`; the MLP's bias + GELU, `kernels::bias_gelu`;
//! LayerNorm and RMSNorm, `kernels::layer_norm`; the rotary embedding, `kernels::rope`) against
//! the decomposed ops: one training step's loss and every parameter's gradient. On the CPU
//! backend the fused path is Flex's loops; on wgpu (lavapipe on CI) the CubeCL kernels, and the
//! reference in Burn ops for the norms and the rotation.

use burn::backend::Autodiff;
use burn::module::Module;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, ElementConversion, Int, Tensor};
use wildfire_backend::compare::relative_difference;
use wildfire_backend::device::FusedWgpu;
use wildfire_backend::kernels::choice::FusedOps;
use wildfire_backend::kernels::probe;
use wildfire_backend::{DecoratedBackend, Parallel};
use wildfire_recipes::CpuBackend;
use wildfire_recipes::model::params::collect_params;
use wildfire_recipes::model::{Gpt, Preset, StageSpec};

/// The loss of one batch and the gradient of every parameter (by name), with the fused ops on
/// or off, from the same initialisation and tokens.
fn step<A: AutodiffBackend + DecoratedBackend>(
    device: &A::Device,
    preset: Preset,
    fused: bool,
) -> (f32, Vec<(String, Vec<f32>)>) {
    let config = preset.config(65);
    let device = device.clone();
    A::seed(&device, 7);
    let model = Gpt::<A>::new(&config, StageSpec::whole(&config), &device)
        .with_fused_ops(FusedOps::all(fused));
    let tokens = Tensor::<A, 2, Int>::random([4, 128], Distribution::Uniform(0.0, 65.0), &device);
    let targets = Tensor::<A, 2, Int>::random([4, 128], Distribution::Uniform(0.0, 65.0), &device);
    let loss = model.loss_sum(model.forward(tokens), targets) / (4.0 * 128.0);
    let value = loss.clone().into_scalar().elem::<f32>();
    let grads = loss.backward();
    let mut by_name = Vec::new();
    let params = collect_params(&model, 0);
    let mut visitor = Grads::<A> {
        grads: &grads,
        found: Vec::new(),
    };
    model.visit(&mut visitor);
    for ((name, _, _), grad) in params.into_iter().zip(visitor.found) {
        by_name.push((name, grad));
    }
    (value, by_name)
}

struct Grads<'a, A: AutodiffBackend> {
    grads: &'a A::Gradients,
    found: Vec<Vec<f32>>,
}

impl<A: AutodiffBackend> burn::module::ModuleVisitor<A> for Grads<'_, A> {
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<A, D>>) {
        let grad = param
            .val()
            .grad(self.grads)
            .expect("every parameter has a gradient");
        self.found.push(grad.into_data().to_vec().unwrap());
    }
}

/// Tolerance: 1e-5 of each gradient's largest magnitude, and 1e-6 relative on the loss. The two
/// attentions sum the same terms in different orders (the fused one tile by tile with a running
/// maximum), and the fused GELU's slope is one closed form where the decomposed graph chains a
/// dozen ops, so values differ by a few f32 ulps; the backward carries those differences
/// through four blocks.
#[test]
fn a_training_step_with_fused_ops_matches_the_decomposed_one() {
    compare_steps::<Autodiff<CpuBackend>>(&Default::default(), F32_SUMS);
}

/// The tolerances of [`compare_steps`]: on the loss (relative) and on each gradient (of its
/// largest magnitude).
struct Tolerance {
    loss: f32,
    gradient: f32,
}

/// Both paths in f32 arithmetic, summing in different orders.
const F32_SUMS: Tolerance = Tolerance {
    loss: 1e-6,
    gradient: 1e-5,
};

/// The same on `Autodiff<Parallel<FusedWgpu>>` (what `--device wgpu` trains on), where the fused
/// path is the CubeCL kernels queued in Burn's fusion stream and the decomposed one Burn's ops
/// under its fusion. Without a wgpu adapter it reports itself skipped, unless
/// `WILDFIRE_REQUIRE_WGPU=1` (CI).
#[test]
fn on_wgpu_the_kernels_train_like_the_decomposed_ops() {
    if let Some(device) = probe::for_test(probe::wgpu(), "WILDFIRE_REQUIRE_WGPU") {
        compare_steps::<Autodiff<Parallel<FusedWgpu>>>(&device, F32_SUMS);
    }
}

/// The same on `Autodiff<Parallel<FusedCuda>>` (`--features cuda`; `scripts/gpu-check.sh`). Burn's
/// f32 matmuls, which the decomposed attention uses, run on TF32 tensor cores there (inputs
/// rounded to 2⁻¹¹), the fused kernels in f32 arithmetic: the two paths differ by a few TF32
/// roundings of the attention scores, carried through four blocks' backward, so the tolerance is
/// TF32's (2⁻¹¹ ≈ 5e-4) with the backward's growth, still far below a wrong kernel's O(1).
#[cfg(feature = "cuda")]
#[test]
fn on_cuda_the_kernels_train_like_the_decomposed_ops() {
    if let Some(device) = probe::for_test(probe::cuda(), "WILDFIRE_REQUIRE_CUDA") {
        let tf32 = Tolerance {
            loss: 1e-4,
            gradient: 1e-2,
        };
        compare_steps::<Autodiff<Parallel<wildfire_backend::device::FusedCuda>>>(&device, tf32);
    }
}

/// [`compare_preset`] for the tiny GPT and llama-tiny.
fn compare_steps<A: AutodiffBackend + DecoratedBackend>(device: &A::Device, tolerance: Tolerance) {
    for preset in [Preset::Tiny, Preset::LlamaTiny] {
        compare_preset::<A>(device, preset, &tolerance);
    }
}

fn compare_preset<A: AutodiffBackend + DecoratedBackend>(
    device: &A::Device,
    preset: Preset,
    tolerance: &Tolerance,
) {
    let (fused_loss, fused) = step::<A>(device, preset, true);
    let (loss, decomposed) = step::<A>(device, preset, false);
    assert!(
        ((fused_loss - loss) / loss).abs() < tolerance.loss,
        "{preset:?} loss: fused {fused_loss}, decomposed {loss}"
    );
    let mut identical = true;
    for ((name, a), (_, b)) in fused.iter().zip(&decomposed) {
        let worst = relative_difference(a, b) as f32;
        assert!(
            worst < tolerance.gradient,
            "{preset:?} {name}: gradients differ by {worst:e} of their largest"
        );
        identical &= a == b;
    }
    assert!(
        !identical,
        "{preset:?}: the two paths computed bitwise the same: are the fused ops on?"
    );
}
