//! Global gradient-norm clipping, as `torch.nn.utils.clip_grad_norm_` defines it, over a
//! module's gradients or over a model spread across ranks; and the one factor that unscales an
//! fp16 loss-scaled gradient and clips it.
//!
//! ```text
//! n = √(Σ_p ‖g_p‖²)          c = max_norm / (n + 10⁻⁶)          g ← c·g   when c < 1
//! ```
//!
//! Everything here runs on the device: the norm, the factor and the scaling are tensors, and
//! the host reads none of them (so a GPU never waits for the host here). Each `‖g_p‖²` is
//! reduced by the backend in the gradient's type, and the terms are summed in the device's
//! widest float (f64 on the CPU; see [`crate::device_value`]).
//!
//! Burn's own `GradientClipping::Norm` bounds each tensor's norm separately, which is a
//! different (and model-size dependent) rule.

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{FloatDType, Tensor};

use crate::device_value::{fold_sum, module_inner_device};

/// The inner backend of autodiff backend `B`, where gradients live.
type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// `Σ‖g_p‖²` over the parameters of `module` that have gradients, except those in `skip` (e.g.
/// a copy of a parameter that another rank counts), on the device: each term reduced by the
/// backend in the gradient's type, the terms folded in module order in the device's widest
/// float (`device_value::fold_sum`: f64 on the CPU, where the value is the host's f64 sum of
/// the same terms). Nothing is read back.
pub fn grad_sum_of_squares<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
    skip: &[ParamId],
) -> Tensor<Inner<B>, 1> {
    grad_sum_of_squares_where(module, grads, |id| !skip.contains(&id))
}

/// `Σ‖g_p‖²` over the parameters of `module` that have gradients and that `counted` accepts,
/// in module order, on the device (see [`grad_sum_of_squares`]).
pub fn grad_sum_of_squares_where<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
    counted: impl Fn(ParamId) -> bool,
) -> Tensor<Inner<B>, 1> {
    struct Squares<'a, B: Backend, F> {
        grads: &'a GradientsParams,
        counted: F,
        terms: Vec<Tensor<B, 1>>,
    }
    impl<B: AutodiffBackend, F: Fn(ParamId) -> bool> ModuleVisitor<B> for Squares<'_, Inner<B>, F> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if !(self.counted)(param.id) {
                return;
            }
            if let Some(grad) = self.grads.get::<Inner<B>, D>(param.id) {
                self.terms.push(grad.square().sum());
            }
        }
    }
    let mut squares = Squares {
        grads,
        counted,
        terms: Vec::new(),
    };
    module.visit(&mut squares);
    fold_sum(squares.terms, &module_inner_device(module))
}

/// Global gradient-norm clipping of one module's gradients (see the module doc): returns the
/// norm before clipping, on the device. `max_norm = 0` only measures.
pub fn clip_global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> Tensor<Inner<B>, 1> {
    let norm = grad_sum_of_squares(module, grads, &[]).sqrt();
    if let Some(factor) = unscale_and_clip(norm.clone(), max_norm, 1.0) {
        scale_grads(module, grads, factor);
    }
    norm
}

/// The factor that unscales gradients of `loss_scale · L` and clips them to `max_norm`, given
/// their true norm `norm` (on the device, in its type):
///
/// ```text
/// f = min(1, max_norm / (norm + 10⁻⁶)) / loss_scale       (max_norm > 0)
/// f = 1 / loss_scale                                       (max_norm = 0: no clipping)
/// ```
///
/// computed on the device, so the host never waits for the norm. `None` when the factor is 1
/// whatever the norm (no clipping, no loss scale): nothing to multiply. A norm that is not
/// finite gives a factor that is not finite either.
pub fn unscale_and_clip<B: Backend>(
    norm: Tensor<B, 1>,
    max_norm: f64,
    loss_scale: f64,
) -> Option<Tensor<B, 1>> {
    let options = (&norm.device(), norm.dtype());
    if max_norm <= 0.0 {
        return (loss_scale != 1.0).then(|| Tensor::ones([1], options) / loss_scale);
    }
    let clip = Tensor::full([1], max_norm, options) / (norm + 1e-6);
    Some(clip.clamp_max(1.0) / loss_scale)
}

/// Multiplies every gradient of `module` by `factor` (a one-element tensor on the device),
/// rounded to each gradient's type.
pub fn scale_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    factor: Tensor<Inner<B>, 1>,
) {
    struct Scale<'a, B: Backend> {
        grads: &'a mut GradientsParams,
        factor: Tensor<B, 1>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_, Inner<B>> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.remove::<Inner<B>, D>(param.id) {
                let scaled = scaled_by(grad, &self.factor);
                self.grads.register(param.id, scaled);
            }
        }
    }
    module.visit(&mut Scale { grads, factor });
}

/// `tensor · factor` for a one-element `factor`, rounded to `tensor`'s type first: the product
/// `tensor.mul_scalar(f)` gives for the host value `f`.
pub fn scaled_by<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
    factor: &Tensor<B, 1>,
) -> Tensor<B, D> {
    let dtype = FloatDType::from(tensor.dtype());
    let factor = factor.clone().cast(dtype).reshape([1; D]);
    tensor * factor
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};
    use burn::nn::LinearConfig;
    use burn::tensor::TensorData;

    use super::*;
    use crate::device_value::read_value;

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
        let norm = read_value(clip_global_norm(&linear, &mut grads, 1.0));
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
        let clipped = read_value(grad_sum_of_squares(&linear, &grads, &[])).sqrt();
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
        let norm = read_value(clip_global_norm(&linear, &mut grads, 100.0));
        assert!((norm - 168f64.sqrt()).abs() < 1e-5);
        let bias = grads
            .get::<Flex, 1>(linear.bias.as_ref().unwrap().id)
            .unwrap()
            .into_data();
        assert_eq!(bias, TensorData::from([2.0f32; 3]));
    }

    #[test]
    fn unscaling_and_clipping_is_one_factor() {
        let device = Default::default();
        let f64_options = (&device, burn::tensor::DType::F64);
        let norm = |n: f64| Tensor::<Flex, 1>::from_data(TensorData::from([n]), f64_options);
        let factor =
            |n, max_norm, scale| unscale_and_clip(norm(n), max_norm, scale).map(read_value);
        assert_eq!(factor(0.5, 0.0, 1.0), None, "nothing to multiply");
        assert_eq!(factor(0.5, 1.0, 1.0), Some(1.0), "below the bound");
        assert_eq!(factor(0.5, 1.0, 4.0), Some(0.25));
        assert_eq!(factor(0.5, 0.0, 4.0), Some(0.25), "unscaling alone");
        let clipped = factor(4.0, 1.0, 2.0).unwrap();
        assert_eq!(clipped.to_bits(), (1.0 / (4.0 + 1e-6) / 2.0f64).to_bits());
    }
}
