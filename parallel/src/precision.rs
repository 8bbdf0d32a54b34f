//! Mixed precision: dynamic loss scaling for fp16 training.
//!
//! fp16 cannot hold a magnitude below 2^-24 ≈ 6e-8, its smallest subnormal (and keeps few
//! significant bits well above it), and many of a language model's gradients are that small. Backpropagating `S · L` instead
//! of the loss `L` multiplies every gradient by `S`, which lifts them into fp16's range; the
//! update then uses `g / S`. Too large an `S` overflows some gradient to ±∞ (or NaN), so
//! [`DynamicLossScaler`] adapts it, as PyTorch's `GradScaler` and Megatron-LM do:
//!
//! ```text
//! start   S = 2^16
//! overflow anywhere (any gradient, any rank)  → skip the step on every rank, S ← max(S/2, 1)
//! `growth_interval` (1000) clean steps in a row → S ← 2S
//! ```
//!
//! Every rank must take the same decision, or the replicas diverge: a rank's own verdict
//! ([`has_non_finite`]) is combined over the group with [`overflow_anywhere`] (an all-reduce of
//! the maximum) before [`DynamicLossScaler::update`]. Scales are powers of two, so scaling and
//! unscaling are exact in binary floating point (barring underflow and overflow).

use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Tensor};
use wildfire_backend::comm::{CommError, HostTensor, ProcessGroup, ReduceOp};

/// What to do with a step whose gradients were checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepDecision {
    /// The gradients are finite: unscale them and update.
    Apply,
    /// Some gradient overflowed: leave parameters and optimizer state as they are.
    Skip,
}

/// The loss scale `S` and its adaptation (see the module doc).
#[derive(Debug, Clone, PartialEq)]
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
        if self.clean_steps == self.growth_interval {
            self.scale *= 2.0;
            self.clean_steps = 0;
        }
        StepDecision::Apply
    }
}

/// Whether `tensor` holds an infinite or NaN element. Its sum is checked: any ±∞ or NaN makes
/// the sum non-finite, and so does a sum of finite values beyond the largest float, which
/// would overflow the update anyway.
pub fn has_non_finite<B: Backend, const D: usize>(tensor: &Tensor<B, D>) -> bool {
    let sum: f64 = tensor.clone().sum().into_scalar().elem();
    !sum.is_finite()
}

/// Whether any rank of `group` saw an overflow: every rank's `local` verdict, all-reduced with
/// the maximum, so every rank gets the same answer.
pub fn overflow_anywhere(local: bool, group: &ProcessGroup) -> Result<bool, CommError> {
    if group.size() == 1 {
        return Ok(local);
    }
    let verdict = HostTensor::new(vec![f64::from(u8::from(local))], vec![1]);
    let any = group.all_reduce_host(verdict, ReduceOp::Max)?;
    Ok(any.data[0] > 0.0)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use burn::backend::Flex;
    use burn::tensor::TensorData;
    use wildfire_backend::comm::CommOptions;

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
    fn infinities_and_nans_are_found() {
        let device = Default::default();
        let tensor = |values: Vec<f32>| {
            Tensor::<Flex, 1>::from_data(TensorData::new(values.clone(), [values.len()]), &device)
        };
        assert!(!has_non_finite(&tensor(vec![1.0, -2.0, 3e38])));
        assert!(has_non_finite(&tensor(vec![1.0, f32::INFINITY])));
        assert!(has_non_finite(&tensor(vec![f32::NEG_INFINITY, 1.0])));
        assert!(has_non_finite(&tensor(vec![f32::NAN, 1.0])));
        assert!(has_non_finite(&tensor(vec![
            f32::INFINITY,
            f32::NEG_INFINITY
        ])));
    }

    /// An overflow on one rank skips the step on both, and both scalers stay equal.
    #[test]
    fn one_ranks_overflow_skips_the_step_everywhere() {
        let options = CommOptions {
            timeout: Duration::from_secs(30),
            debug: true,
        };
        let ranks: Vec<_> = ProcessGroup::local_world(2, options)
            .unwrap()
            .into_iter()
            .map(|group| {
                std::thread::spawn(move || {
                    let mut scaler = DynamicLossScaler::default();
                    let local = group.rank() == 1;
                    let decision = scaler.update(overflow_anywhere(local, &group).unwrap());
                    let clean = scaler.update(overflow_anywhere(false, &group).unwrap());
                    (decision, clean, scaler)
                })
            })
            .collect();
        let results: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
        for (decision, clean, scaler) in &results {
            assert_eq!(*decision, StepDecision::Skip);
            assert_eq!(*clean, StepDecision::Apply);
            assert_eq!(scaler.scale(), 32768.0);
        }
        assert_eq!(results[0].2, results[1].2);
    }
}
