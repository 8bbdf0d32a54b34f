//! The data-parallel update ([`Update`]) as the optimizer burn-train's `Learner` holds, for a
//! loop that drives the Learner itself (a custom `SupervisedLearningStrategy`): the Learner
//! holds the model and this optimizer; each step the loop sets the step's loss scale, calls
//! `Learner::optimizer_step`, and takes what the update measured, or why it failed, from
//! [`LearnerUpdate::take_stats`]. Clones share one update, so the loop keeps one to read the
//! optimizer's state (checkpoints, ZeRO 3's units).
//!
//! Burn's `Optimizer::step` cannot fail: a failed update hands the Learner its model back as it
//! was and keeps the error for the loop.

use std::sync::{Arc, Mutex};

use burn::module::{AutodiffModule, ParamId};
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use wildfire_backend::comm::ProcessGroup;

use crate::update::{
    StepOptions, Update, UpdateError, UpdateGroups, UpdateStats, lock, one_device_grads,
};

/// A Burn optimizer over a shared [`Update`] (see the module doc).
pub struct LearnerUpdate<A: AutodiffBackend, O> {
    shared: Arc<Shared<A, O>>,
}

struct Shared<A: AutodiffBackend, O> {
    update: Update<A, O>,
    world: ProcessGroup,
    replica: ProcessGroup,
    data: ProcessGroup,
    max_norm: f64,
    counted_elsewhere: Vec<ParamId>,
    /// fp16's dynamic loss scale of the next steps, if any.
    loss_scale: Mutex<Option<f64>>,
    outcome: Mutex<Option<Result<UpdateStats<A::InnerBackend>, UpdateError>>>,
}

impl<A: AutodiffBackend, O> Clone for LearnerUpdate<A, O> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<A: AutodiffBackend, O> std::fmt::Debug for LearnerUpdate<A, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LearnerUpdate")
            .field("update", &self.shared.update)
            .field("max_norm", &self.shared.max_norm)
            .finish_non_exhaustive()
    }
}

impl<A: AutodiffBackend, O> LearnerUpdate<A, O> {
    /// `update` over `groups`, clipping to `max_norm` (0: measure only), leaving the
    /// parameters `counted_elsewhere` out of the norm (see [`StepOptions`]).
    pub fn new(
        update: Update<A, O>,
        groups: UpdateGroups,
        max_norm: f64,
        counted_elsewhere: Vec<ParamId>,
    ) -> Self {
        let shared = Shared {
            update,
            world: groups.world.clone(),
            replica: groups.replica.clone(),
            data: groups.data.clone(),
            max_norm,
            counted_elsewhere,
            loss_scale: Mutex::new(None),
            outcome: Mutex::new(None),
        };
        Self {
            shared: Arc::new(shared),
        }
    }

    /// The update the Learner steps with.
    pub fn update(&self) -> &Update<A, O> {
        &self.shared.update
    }

    /// The gradients of the next steps are those of `S · L` for fp16's dynamic loss scale
    /// `loss_scale = Some(S)`, or of `L` (`None`). Under a loss scale a step whose gradient
    /// overflowed is skipped, which reads the norm back each step
    /// ([`StepOptions::skip_overflow`]).
    pub fn set_loss_scale(&self, loss_scale: Option<f64>) {
        *lock(&self.shared.loss_scale) = loss_scale;
    }

    /// What the last step measured, or why it failed; an error when no step ran since the
    /// last call.
    pub fn take_stats(&self) -> Result<UpdateStats<A::InnerBackend>, UpdateError> {
        lock(&self.shared.outcome)
            .take()
            .unwrap_or(Err(UpdateError::NoStep))
    }
}

impl<A, M, O> Optimizer<M, A> for LearnerUpdate<A, O>
where
    A: AutodiffBackend,
    M: AutodiffModule<A>,
    O: Optimizer<M, A>,
{
    /// The loop checkpoints the optimizer's state itself (through [`LearnerUpdate::update`]).
    type Record = ();

    fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> M {
        let shared = &*self.shared;
        let groups = UpdateGroups {
            world: &shared.world,
            replica: &shared.replica,
            data: &shared.data,
        };
        let loss_scale = *lock(&shared.loss_scale);
        let options = StepOptions {
            loss_scale: loss_scale.unwrap_or(1.0),
            skip_overflow: loss_scale.is_some(),
            counted_elsewhere: &shared.counted_elsewhere,
            ..StepOptions::new(lr, shared.max_norm)
        };
        let before = module.clone();
        let (module, outcome) = match shared.update.update(groups, module, grads, options) {
            Ok((module, stats)) => (module, Ok(stats)),
            Err(error) => (before, Err(error)),
        };
        *lock(&shared.outcome) = Some(outcome);
        module
    }

    fn step_multi(&mut self, lr: f64, module: M, grads: MultiGradientsParams) -> M {
        match one_device_grads(grads) {
            Ok(grads) => self.step(lr, module, grads),
            Err(error) => {
                *lock(&self.shared.outcome) = Some(Err(error));
                module
            }
        }
    }

    fn to_record(&self) -> Self::Record {}

    fn load_record(self, _record: Self::Record) -> Self {
        self
    }
}
