//! Global gradient-norm clipping, as `torch.nn.utils.clip_grad_norm_` defines it, over a
//! module's gradients or over a model spread across ranks; and the one factor that unscales an
//! fp16 loss-scaled gradient and clips it.
//!
//! ```text
//! n = √(Σ_p ‖g_p‖²)          c = max_norm / (n + 10⁻⁶)          g ← c·g   when c < 1
//! ```
//!
//! Burn's own `GradientClipping::Norm` bounds each tensor's norm separately, which is a
//! different (and model-size dependent) rule.

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor};

/// Visits every float parameter that has a gradient, in module order.
struct GradVisitor<'a, F> {
    grads: &'a GradientsParams,
    each: F,
}

impl<B, F> ModuleVisitor<B> for GradVisitor<'_, F>
where
    B: AutodiffBackend,
    F: FnMut(ParamId, f64),
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let squares = grad.square().sum().into_scalar().elem::<f64>();
            (self.each)(param.id, squares);
        }
    }
}

/// Σ‖g_p‖² over the parameters of `module` that have gradients, except those in `skip` (e.g. a
/// copy of a parameter that another rank counts): each term reduced by the backend and summed
/// here in f64, in module order (so the value is deterministic).
pub fn grad_sum_of_squares<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
    skip: &[ParamId],
) -> f64 {
    grad_sum_of_squares_where(module, grads, |id| !skip.contains(&id))
}

/// Σ‖g_p‖² over the parameters of `module` that have gradients and that `counted` accepts, in
/// module order.
pub fn grad_sum_of_squares_where<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
    counted: impl Fn(ParamId) -> bool,
) -> f64 {
    let mut total = 0.0;
    module.visit(&mut GradVisitor {
        grads,
        each: |id, squares| {
            if counted(id) {
                total += squares;
            }
        },
    });
    total
}

/// Global gradient-norm clipping of one module's gradients (see the module doc): returns the
/// norm before clipping. `max_norm = 0` only measures.
pub fn clip_global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> f64 {
    let squares = grad_sum_of_squares(module, grads, &[]);
    clip_to_norm(module, grads, max_norm, squares)
}

/// [`clip_global_norm`] when the model is spread over ranks: `sum_of_squares` is `Σ_p ‖g_p‖²`
/// over the *whole* model (every rank's share, each parameter counted once), and `module` and
/// `grads` are this rank's part. Returns the global norm.
pub fn clip_to_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
    sum_of_squares: f64,
) -> f64 {
    let norm = sum_of_squares.sqrt();
    if let Some(factor) = clip_factor(norm, max_norm) {
        scale_grads(module, grads, factor);
    }
    norm
}

/// The factor `c = max_norm / (norm + 10⁻⁶)` that clips a gradient of norm `norm`, when
/// clipping is on (`max_norm > 0`) and `c < 1`.
pub fn clip_factor(norm: f64, max_norm: f64) -> Option<f64> {
    let factor = max_norm / (norm + 1e-6);
    (max_norm > 0.0 && factor < 1.0).then_some(factor)
}

/// Multiplies every gradient of `module` by `factor`.
pub fn scale_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    factor: f64,
) {
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f64,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                self.grads.register(param.id, grad.mul_scalar(self.factor));
            }
        }
    }
    module.visit(&mut Scale { grads, factor });
}

/// The factor that unscales gradients of `loss_scale · L` and clips them to `max_norm` (given
/// their true norm), or `None` when it is 1.
pub fn unscale_and_clip(grad_norm: f64, max_norm: f64, loss_scale: f64) -> Option<f64> {
    let factor = clip_factor(grad_norm, max_norm).unwrap_or(1.0) / loss_scale;
    (factor != 1.0).then_some(factor)
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};
    use burn::nn::LinearConfig;
    use burn::tensor::TensorData;

    use super::*;

    type B = Autodiff<Flex>;

    /// `L = Σ(xW + b)` for `x = [[1, 2], [3, 4]]` has `∂L/∂W = [[4, 4, 4], [6, 6, 6]]` (column
    /// sums of x, per output) and `∂L/∂b = [2, 2, 2]`, so the global norm is √(3·16 + 3·36 + 3·4)
    /// = √168, and clipping to 1 scales both by 1/(√168 + 10⁻⁶).
    #[test]
    fn global_clipping_matches_the_hand_computation() {
        let device = Default::default();
        let linear = LinearConfig::new(2, 3).init::<B>(&device);
        let x = Tensor::<B, 2>::from_data(TensorData::from([[1.0f32, 2.0], [3.0, 4.0]]), &device);
        let grads = linear.forward(x).sum().backward();
        let mut grads = GradientsParams::from_grads(grads, &linear);
        let norm = clip_global_norm(&linear, &mut grads, 1.0);
        assert!((norm - 168f64.sqrt()).abs() < 1e-5, "norm {norm}");
        let scale = (1.0 / (168f64.sqrt() + 1e-6)) as f32;
        let weight = grads.get::<Flex, 2>(linear.weight.id).unwrap().into_data();
        let bias = grads
            .get::<Flex, 1>(linear.bias.as_ref().unwrap().id)
            .unwrap()
            .into_data();
        weight.assert_approx_eq::<f32>(
            &TensorData::from([[4.0 * scale; 3], [6.0 * scale; 3]]),
            burn::tensor::Tolerance::absolute(1e-6),
        );
        bias.assert_approx_eq::<f32>(
            &TensorData::from([2.0 * scale; 3]),
            burn::tensor::Tolerance::absolute(1e-6),
        );
        let clipped = grad_sum_of_squares(&linear, &grads, &[]).sqrt();
        assert!(
            (clipped - 1.0).abs() < 1e-5,
            "norm after clipping {clipped}"
        );
    }

    #[test]
    fn norms_below_the_bound_are_left_alone() {
        let device = Default::default();
        let linear = LinearConfig::new(2, 3).init::<B>(&device);
        let x = Tensor::<B, 2>::from_data(TensorData::from([[1.0f32, 2.0], [3.0, 4.0]]), &device);
        let mut grads = GradientsParams::from_grads(linear.forward(x).sum().backward(), &linear);
        let norm = clip_global_norm(&linear, &mut grads, 100.0);
        assert!((norm - 168f64.sqrt()).abs() < 1e-5);
        let bias = grads
            .get::<Flex, 1>(linear.bias.as_ref().unwrap().id)
            .unwrap()
            .into_data();
        assert_eq!(bias, TensorData::from([2.0f32; 3]));
    }

    #[test]
    fn unscaling_and_clipping_is_one_factor() {
        assert_eq!(unscale_and_clip(0.5, 1.0, 1.0), None);
        assert_eq!(unscale_and_clip(0.5, 1.0, 4.0), Some(0.25));
        let factor = unscale_and_clip(4.0, 1.0, 2.0).unwrap();
        assert!((factor - 1.0 / (4.0 + 1e-6) / 2.0).abs() < 1e-15);
    }
}
