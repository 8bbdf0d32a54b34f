//! The step's numbers as burn-train metrics. The training loop computes them (loss, learning
//! rate, gradient norm, tokens/s, MFU); each metric here only reads its field, so burn-train's
//! event processing, renderers and metric loggers see exactly what the loop logged elsewhere.

use std::marker::PhantomData;
use std::sync::Arc;

use super::LossScaleRecord;

use burn::train::ItemLazy;
use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Adaptor, Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes,
    NumericEntry, SerializedEntry,
};

/// What one training micro-batch (or one evaluation batch) reports. The loop fills the
/// step-level fields on the last micro-batch of a step.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// Σ token losses of the batch.
    pub loss_sum: f64,
    /// Tokens (target positions) in the batch.
    pub tokens: usize,
    /// Mean loss per token over the whole optimizer step.
    pub step_loss: Option<f64>,
    pub grad_norm: Option<f64>,
    pub tokens_per_sec: Option<f64>,
    pub mfu: Option<f64>,
    /// The largest measured pipeline bubble over the ranks (pipeline runs only).
    pub bubble: Option<f64>,
    /// Time in data- and tensor-parallel collectives during the step (see
    /// `StepRecord::comm_ms`).
    pub comm_ms: Option<f64>,
    /// fp16's loss scaling in the step (fp16 runs only).
    pub loss_scale: Option<LossScaleRecord>,
    /// See `StepRecord::activation_peak_mib`.
    pub activation_peak_mib: Option<f64>,
}

impl ItemLazy for StepOutput {
    type ItemSync = Self;
    fn sync(self) -> Self {
        self
    }
}

/// One scalar field of [`StepOutput`].
pub trait Field: Send + Sync + Clone + 'static {
    const NAME: &'static str;
    const UNIT: Option<&'static str>;
    const HIGHER_IS_BETTER: bool;
    fn read(output: &StepOutput) -> Option<f64>;
}

/// The value of field `F`, as a metric input.
#[derive(Debug)]
pub struct FieldValue<F>(Option<f64>, PhantomData<F>);

impl<F: Field> Adaptor<FieldValue<F>> for StepOutput {
    fn adapt(&self) -> FieldValue<F> {
        FieldValue(F::read(self), PhantomData)
    }
}

/// A burn-train numeric metric showing field `F` of [`StepOutput`].
#[derive(Clone)]
pub struct StepScalar<F: Field> {
    name: MetricName,
    state: NumericMetricState,
    _field: PhantomData<F>,
}

impl<F: Field> std::fmt::Debug for StepScalar<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StepScalar({})", F::NAME)
    }
}

impl<F: Field> Default for StepScalar<F> {
    fn default() -> Self {
        Self {
            name: Arc::new(F::NAME.to_string()),
            state: NumericMetricState::new(),
            _field: PhantomData,
        }
    }
}

impl<F: Field> Metric for StepScalar<F> {
    type Input = FieldValue<F>;

    fn name(&self) -> MetricName {
        self.name.clone()
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: F::UNIT.map(str::to_string),
            higher_is_better: F::HIGHER_IS_BETTER,
        }
        .into()
    }

    fn update(&mut self, item: &FieldValue<F>, _metadata: &MetricMetadata) -> SerializedEntry {
        let value = item.0.unwrap_or(f64::NAN);
        let mut format = FormatOptions::new(self.name.clone()).precision(4);
        if let Some(unit) = F::UNIT {
            format = format.unit(unit);
        }
        self.state.update(value, 1, format)
    }

    fn clear(&mut self) {
        self.state.reset();
    }
}

impl<F: Field> Numeric for StepScalar<F> {
    fn value(&self) -> NumericEntry {
        self.state.current_value()
    }
    fn running_value(&self) -> NumericEntry {
        self.state.running_value()
    }
}

macro_rules! field {
    ($ty:ident, $name:literal, $unit:expr, $higher:literal, |$o:ident| $read:expr) => {
        #[derive(Debug, Clone)]
        pub struct $ty;
        impl Field for $ty {
            const NAME: &'static str = $name;
            const UNIT: Option<&'static str> = $unit;
            const HIGHER_IS_BETTER: bool = $higher;
            fn read($o: &StepOutput) -> Option<f64> {
                $read
            }
        }
    };
}

field!(Loss, "Loss", None, false, |o| o
    .step_loss
    .or_else(|| batch_mean(o)));
field!(GradNorm, "Grad norm", None, false, |o| o.grad_norm);
field!(TokensPerSec, "Throughput", Some("tok/s"), true, |o| o
    .tokens_per_sec);
field!(Mfu, "MFU", Some("%"), true, |o| o.mfu.map(|m| 100.0 * m));
field!(Bubble, "Bubble", Some("%"), false, |o| o
    .bubble
    .map(|b| 100.0 * b));

fn batch_mean(output: &StepOutput) -> Option<f64> {
    (output.tokens > 0).then(|| output.loss_sum / output.tokens as f64)
}
