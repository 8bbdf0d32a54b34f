//! Plain-text progress for burn-train when stdout is not a terminal (CI, log files, `tee`):
//! one line per logged step with every training metric, and one line per evaluation.

use std::collections::BTreeMap;

use burn::train::LearnerSummary;
use burn::train::metric::{MetricDefinition, MetricId};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};

/// Prints `step 120/1000 | Loss 2.103 | Learning Rate 9.800e-4 | …` every `every` steps.
#[derive(Debug)]
pub struct LogRenderer {
    /// Print nothing (ranks other than 0 of a parallel run).
    quiet: bool,
    every: usize,
    /// Printed after the metrics: "MFU n/a" when the device's peak is unknown.
    suffix: &'static str,
    names: BTreeMap<String, String>,
    order: Vec<MetricId>,
    train: BTreeMap<String, String>,
    valid: BTreeMap<String, String>,
}

impl LogRenderer {
    /// `mfu_known`: whether an MFU metric is registered; without one the line says "MFU n/a".
    pub fn new(every: usize, mfu_known: bool) -> Self {
        Self {
            quiet: false,
            every: every.max(1),
            suffix: if mfu_known { "" } else { " | MFU n/a" },
            names: BTreeMap::new(),
            order: Vec::new(),
            train: BTreeMap::new(),
            valid: BTreeMap::new(),
        }
    }

    /// A renderer that prints nothing: for the ranks of a parallel run other than rank 0.
    pub fn quiet() -> Self {
        Self {
            quiet: true,
            ..Self::new(1, true)
        }
    }

    /// Keeps the metric's current value (numeric) or its formatted text (others).
    fn remember(values: &mut BTreeMap<String, String>, state: MetricState) {
        let (key, text) = match state {
            MetricState::Numeric(entry, value) => {
                (id_key(&entry.metric_id), format_value(value.current()))
            }
            MetricState::Generic(entry) => {
                (id_key(&entry.metric_id), entry.serialized_entry.formatted)
            }
        };
        values.insert(key, text);
    }

    /// `name value` for every registered metric that has a value: the recipe's metrics in
    /// [`ORDER`], then any others in registration order.
    fn line(&self, values: &BTreeMap<String, String>) -> String {
        let rank = |id: &&MetricId| {
            let name = self
                .names
                .get(&id_key(id))
                .map(String::as_str)
                .unwrap_or("");
            ORDER.iter().position(|n| *n == name).unwrap_or(ORDER.len())
        };
        let mut order: Vec<&MetricId> = self.order.iter().collect();
        order.sort_by_key(rank);
        order
            .into_iter()
            .filter_map(|id| {
                let key = id_key(id);
                Some(format!("{} {}", self.names.get(&key)?, values.get(&key)?))
            })
            .collect::<Vec<_>>()
            .join(" | ")
    }
}

/// Where the recipe's metrics appear in a line.
const ORDER: [&str; 5] = ["Loss", "Learning Rate", "Grad norm", "Throughput", "MFU"];

/// Four significant digits, in scientific notation when that is shorter to read.
fn format_value(value: f64) -> String {
    let magnitude = value.abs();
    if value == 0.0 || (1e-3..1e5).contains(&magnitude) {
        let decimals = (3 - magnitude.log10().floor() as i32).clamp(0, 6) as usize;
        format!("{value:.decimals$}")
    } else {
        format!("{value:.3e}")
    }
}

fn id_key(id: &MetricId) -> String {
    format!("{id:?}")
}

impl MetricsRendererTraining for LogRenderer {
    fn update_train(&mut self, state: MetricState) {
        Self::remember(&mut self.train, state);
    }

    fn update_valid(&mut self, state: MetricState) {
        Self::remember(&mut self.valid, state);
    }

    fn render_train(&mut self, item: TrainingProgress, _indicators: Vec<ProgressType>) {
        let (Some(step), Some(progress)) = (item.iteration, item.progress) else {
            return;
        };
        if self.quiet {
            return;
        }
        if step % self.every == 0 || step + 1 == progress.items_total {
            let line = self.line(&self.train);
            println!(
                "step {step}/{} | {line}{}",
                progress.items_total, self.suffix
            );
        }
    }

    fn render_valid(&mut self, item: TrainingProgress, _indicators: Vec<ProgressType>) {
        if let Some(step) = item.iteration.filter(|_| !self.quiet) {
            println!("eval at step {step} | {}", self.line(&self.valid));
        }
    }

    fn on_train_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for LogRenderer {
    fn update_test(&mut self, _name: EvaluationName, state: MetricState) {
        Self::remember(&mut self.valid, state);
    }

    fn render_test(&mut self, _item: EvaluationProgress, _indicators: Vec<ProgressType>) {}
}

impl MetricsRenderer for LogRenderer {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        let key = id_key(&definition.metric_id);
        if !self.names.contains_key(&key) {
            self.order.push(definition.metric_id.clone());
        }
        self.names.insert(key, definition.name);
    }
}
