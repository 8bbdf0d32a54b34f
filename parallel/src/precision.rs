//! Mixed precision: the compute precision of a run, and dynamic loss scaling for fp16.
//!
//! **Autocast.** Under [`Precision::Bf16`] or [`Precision::Fp16`] the parameters (the master
//! weights) and the optimizer state stay fp32. A model casts each weight to the compute type
//! where it is used ([`in_dtype`]), so the cast is a node of the autodiff graph and the
//! gradient arrives at the fp32 leaf as fp32: gradients are accumulated, reduced over the ranks
//! and clipped in fp32. Matmuls and elementwise ops run in the compute type (a backend's
//! half-precision matmul accumulates in fp32); LayerNorm, softmax and the loss cast their input
//! to fp32 and run there, as PyTorch's autocast and Megatron-LM do, because their sums lose too
//! much in 8 (bf16) or 11 (fp16) significant bits.
//!
//! **Loss scaling.** fp16 cannot hold a magnitude below 2^-24 ≈ 6e-8, its smallest subnormal
//! (and keeps few significant bits well above it), and many of a language model's gradients are
//! that small. Backpropagating `S · L` instead of the loss `L` multiplies every gradient by
//! `S`, which lifts them into fp16's range; the update then uses `g / S`. Too large an `S`
//! overflows some gradient to ±∞ (or NaN), so [`DynamicLossScaler`] adapts it, as PyTorch's
//! `GradScaler` and Megatron-LM do:
//!
//! ```text
//! start   S = 2^16
//! overflow anywhere (any gradient, any rank)  → skip the step on every rank, S ← max(S/2, 1)
//! `growth_interval` (1000) clean steps in a row → S ← 2S
//! ```
//!
//! Every rank must take the same decision, or the replicas diverge. A trainer that computes the
//! global gradient norm `‖S·g‖` (a sum of squares over every rank) has the verdict for free:
//! a ±∞ or NaN anywhere makes that sum non-finite on every rank. The norm is computed on the
//! device, so learning the verdict is a read of it: the one blocking read of an fp16 step
//! (`StepOptions::skip_overflow` in [`crate::update`]). Scales are powers of two, so scaling and
//! unscaling are exact in binary floating point (barring underflow and overflow).

use std::fmt;
use std::str::FromStr;

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use serde::{Deserialize, Serialize};

/// The precision a model computes in; parameters and optimizer state are fp32 in every case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    Fp32,
    /// bfloat16 compute: fp32's range with 8 significant bits; needs no loss scaling.
    Bf16,
    /// IEEE half compute: 11 significant bits, magnitudes 6e-8 … 65504; needs loss scaling.
    Fp16,
}

impl Precision {
    /// The type activations and matmuls use.
    pub fn compute_dtype(self) -> FloatDType {
        match self {
            Self::Fp32 => FloatDType::F32,
            Self::Bf16 => FloatDType::BF16,
            Self::Fp16 => FloatDType::F16,
        }
    }

    /// Whether training needs a loss scale (fp16's narrow range).
    pub fn scales_loss(self) -> bool {
        self == Self::Fp16
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Fp32 => "fp32",
            Self::Bf16 => "bf16",
            Self::Fp16 => "fp16",
        })
    }
}

impl FromStr for Precision {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "fp32" => Ok(Self::Fp32),
            "bf16" => Ok(Self::Bf16),
            "fp16" => Ok(Self::Fp16),
            other => Err(format!(
                "precision {other:?} is not one of fp32, bf16, fp16"
            )),
        }
    }
}

pub use wildfire_backend::kernels::in_dtype;

/// `f(x)` computed in fp32 and returned in `x`'s type: for the ops autocast keeps in fp32
/// (normalisations, softmax), whose parameters, if any, are fp32 masters.
pub fn in_fp32<B: Backend, const D: usize, const E: usize>(
    x: Tensor<B, D>,
    f: impl FnOnce(Tensor<B, D>) -> Tensor<B, E>,
) -> Tensor<B, E> {
    let dtype = FloatDType::from(x.dtype());
    in_dtype(f(in_dtype(x, FloatDType::F32)), dtype)
}

/// What to do with a step whose gradients were checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepDecision {
    /// The gradients are finite: unscale them and update.
    Apply,
    /// Some gradient overflowed: leave parameters and optimizer state as they are.
    Skip,
}

/// The loss scale `S` and its adaptation (see the module doc). Its whole state serializes, so a
/// checkpoint can resume it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DynamicLossScaler {
    scale: f64,
    growth_interval: u32,
    /// Clean steps since the last overflow or growth.
    clean_steps: u32,
    skipped_steps: u64,
}

/// Why a loss scaler cannot be built, with the values given.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ScalerError {
    #[error("the initial loss scale must be a power of two of at least 1, got {0}")]
    Scale(f64),
    #[error("the loss scale's growth interval must be at least 1 step, got 0")]
    Interval,
}

impl Default for DynamicLossScaler {
    /// `S = 2^16`, doubled after 1000 clean steps.
    fn default() -> Self {
        Self {
            scale: 65536.0,
            growth_interval: 1000,
            clean_steps: 0,
            skipped_steps: 0,
        }
    }
}

impl DynamicLossScaler {
    /// A scaler starting at `scale` (a power of two, ≥ 1) that doubles it after
    /// `growth_interval` clean steps in a row.
    pub fn new(scale: f64, growth_interval: u32) -> Result<Self, ScalerError> {
        let power_of_two = scale >= 1.0 && scale.is_finite() && scale.log2().fract() == 0.0;
        if !power_of_two {
            return Err(ScalerError::Scale(scale));
        }
        if growth_interval == 0 {
            return Err(ScalerError::Interval);
        }
        Ok(Self {
            scale,
            growth_interval,
            ..Self::default()
        })
    }

    /// The current scale `S`: backpropagate `S · L`.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// This scaler (its settings) continuing from `saved`'s state: the scale, the clean steps
    /// since the last change and the skipped steps of a resumed run.
    pub fn continuing(self, saved: &Self) -> Self {
        Self {
            scale: saved.scale,
            clean_steps: saved.clean_steps,
            skipped_steps: saved.skipped_steps,
            ..self
        }
    }

    /// Clean steps in a row after which the scale doubles.
    pub fn growth_interval(&self) -> u32 {
        self.growth_interval
    }

    /// Steps skipped for overflow so far.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    /// Records the verdict of a step (`overflow`: some gradient on some rank was not finite,
    /// already agreed over the ranks) and adapts the scale for the next one.
    pub fn update(&mut self, overflow: bool) -> StepDecision {
        if overflow {
            self.scale = (self.scale / 2.0).max(1.0);
            self.clean_steps = 0;
            self.skipped_steps += 1;
            return StepDecision::Skip;
        }
        self.clean_steps += 1;
        if self.clean_steps >= self.growth_interval {
            self.scale *= 2.0;
            self.clean_steps = 0;
        }
        StepDecision::Apply
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::{DType, TensorData};

    use super::*;

    #[test]
    fn an_overflow_halves_the_scale_and_skips_the_step() {
        let mut scaler = DynamicLossScaler::default();
        assert_eq!(scaler.scale(), 65536.0);
        assert_eq!(scaler.update(true), StepDecision::Skip);
        assert_eq!(scaler.scale(), 32768.0);
        assert_eq!(scaler.skipped_steps(), 1);
        assert_eq!(scaler.update(false), StepDecision::Apply);
        assert_eq!(scaler.scale(), 32768.0);
    }

    #[test]
    fn the_scale_doubles_after_the_growth_interval_and_never_drops_below_one() {
        let mut scaler = DynamicLossScaler::default();
        for _ in 0..999 {
            assert_eq!(scaler.update(false), StepDecision::Apply);
        }
        assert_eq!(scaler.scale(), 65536.0, "after 999 clean steps");
        scaler.update(false);
        assert_eq!(scaler.scale(), 131072.0, "after 1000 clean steps");
        // An overflow restarts the count.
        let mut scaler = DynamicLossScaler::new(4.0, 3).unwrap();
        scaler.update(false);
        scaler.update(false);
        scaler.update(true);
        scaler.update(false);
        scaler.update(false);
        assert_eq!(scaler.scale(), 2.0, "2 clean steps since the overflow");
        scaler.update(false);
        assert_eq!(scaler.scale(), 4.0);
        for _ in 0..5 {
            assert_eq!(scaler.update(true), StepDecision::Skip);
        }
        assert_eq!(scaler.scale(), 1.0);
        assert_eq!(scaler.skipped_steps(), 6);
    }

    #[test]
    fn bad_settings_name_their_values() {
        assert_eq!(
            DynamicLossScaler::new(3.0, 10).unwrap_err().to_string(),
            "the initial loss scale must be a power of two of at least 1, got 3"
        );
        assert_eq!(
            DynamicLossScaler::new(0.5, 10).unwrap_err(),
            ScalerError::Scale(0.5)
        );
        assert_eq!(
            DynamicLossScaler::new(8.0, 0).unwrap_err(),
            ScalerError::Interval
        );
    }

    #[test]
    fn precisions_parse_and_print() {
        for precision in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
            assert_eq!(precision.to_string().parse::<Precision>(), Ok(precision));
        }
        assert_eq!(
            "fp8".parse::<Precision>().unwrap_err(),
            "precision \"fp8\" is not one of fp32, bf16, fp16"
        );
        assert!(Precision::Fp16.scales_loss() && !Precision::Bf16.scales_loss());
    }

    /// Casts are skipped when the type is already right; fp32 sections return the input's type.
    #[test]
    fn casts_to_the_compute_type_and_back() {
        let device = Default::default();
        let x =
            Tensor::<Flex, 1>::from_data(TensorData::new(vec![1.0f32, 2.5, -3.0], [3]), &device);
        let half = in_dtype(x.clone(), FloatDType::BF16);
        assert_eq!(half.dtype(), DType::BF16);
        let doubled = in_fp32(half, |x| {
            assert_eq!(x.dtype(), DType::F32);
            x * 2.0
        });
        assert_eq!(doubled.dtype(), DType::BF16);
        let back = in_dtype(doubled, FloatDType::F32);
        assert_eq!(
            back.into_data().to_vec::<f32>().unwrap(),
            vec![2.0, 5.0, -6.0]
        );
    }
}
