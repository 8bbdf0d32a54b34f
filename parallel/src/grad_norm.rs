//! The global gradient norm as a burn-train metric under [`crate::DataParallel`].
//!
//! The norm `‖g‖` of the step's reduced gradient (before clipping, under every ZeRO stage: see
//! [`crate::update`]) is known inside the optimizer step, while burn-train's metrics see the
//! train step's output item, later and on another thread. So the three meet in a log: the
//! optimizer notes the norm of the step it just took, the strategy's loop files it under the
//! item's (epoch, iteration) right after the step, and [`GradNormMetric`] takes it from there
//! when that item's metrics are computed. An item without a step of its own (gradient
//! accumulation, or a step skipped for an overflow) shows the last norm again.
//!
//! The norm stays on the device until the metric reads it, on burn-train's metrics thread: the
//! training thread never waits for it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes, NumericEntry,
    SerializedEntry,
};

use crate::device_value::read_value;
use crate::update::lock;

/// The norms of the steps of one run, shared by its optimizers, its loop and its metric.
#[derive(Debug, Clone, Default)]
pub struct GradNorms(Arc<Mutex<Log>>);

#[derive(Default)]
struct Log {
    /// The norm of the step just taken, not yet filed.
    latest: Option<UnreadNorm>,
    /// Filed norms by (epoch, iteration), until the metric takes them.
    filed: HashMap<(usize, usize), UnreadNorm>,
}

impl std::fmt::Debug for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Log")
            .field("latest", &self.latest.is_some())
            .field("filed", &self.filed.len())
            .finish()
    }
}

/// A norm still on the device, and the read that brings it to the host.
type UnreadNorm = Box<dyn FnOnce() -> f64 + Send>;

impl GradNorms {
    /// Notes the norm of the step just taken, a one-element tensor on the device (`None`: the
    /// step was skipped). It is read when the metric shows it.
    pub fn note<B: Backend>(&self, norm: Option<Tensor<B, 1>>) {
        let unread = norm.map(|norm| -> UnreadNorm { Box::new(move || read_value(norm)) });
        lock(&self.0).latest = unread;
    }

    /// Files the last noted norm under the item `(epoch, iteration)` that stepped.
    pub fn file(&self, epoch: usize, iteration: usize) {
        let mut log = lock(&self.0);
        if let Some(norm) = log.latest.take() {
            log.filed.insert((epoch, iteration), norm);
        }
    }

    /// The norm filed under `(epoch, iteration)`, taken out of the log and read.
    fn take(&self, epoch: usize, iteration: usize) -> Option<f64> {
        let unread = lock(&self.0).filed.remove(&(epoch, iteration));
        unread.map(|read| read())
    }

    /// The metric that shows these norms (register it with `metric_train_numeric`).
    pub fn metric(&self) -> GradNormMetric {
        GradNormMetric {
            norms: self.clone(),
            shown: f64::NAN,
            state: NumericMetricState::new(),
        }
    }
}

/// The global gradient norm before clipping, a numeric train metric ("Gradient Norm"); made
/// by [`crate::DataParallel::grad_norm_metric`].
#[derive(Clone)]
pub struct GradNormMetric {
    norms: GradNorms,
    shown: f64,
    state: NumericMetricState,
}

impl std::fmt::Debug for GradNormMetric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradNormMetric")
            .field("shown", &self.shown)
            .finish_non_exhaustive()
    }
}

impl Metric for GradNormMetric {
    type Input = ();

    fn name(&self) -> MetricName {
        Arc::new("Gradient Norm".to_string())
    }

    fn update(&mut self, _item: &(), metadata: &MetricMetadata) -> SerializedEntry {
        let epoch = metadata.global_progress.items_processed;
        let iteration = metadata.iteration.unwrap_or(0);
        if let Some(norm) = self.norms.take(epoch, iteration) {
            self.shown = norm;
        }
        let format = FormatOptions::new(self.name()).precision(4);
        self.state.update(self.shown, 1, format)
    }

    fn clear(&mut self) {
        self.state.reset();
    }

    fn attributes(&self) -> MetricAttributes {
        NumericAttributes {
            unit: None,
            higher_is_better: false,
        }
        .into()
    }
}

impl Numeric for GradNormMetric {
    fn value(&self) -> NumericEntry {
        self.state.current_value()
    }

    fn running_value(&self) -> NumericEntry {
        self.state.running_value()
    }
}
