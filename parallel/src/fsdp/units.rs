//! ZeRO stage 3 (FSDP): a step over a model cut into units (e.g. one transformer block each),
//! whose parameters exist whole only while one unit computes.
//!
//! With units `u_0 … u_{K−1}` (the last computes the loss) and micro-batches `1 … m`:
//!
//! ```text
//! forward   for k < K−1:  θ_k ← all-gather(owned parts)
//!                         for each micro-batch: x_{k+1} = u_k(θ_k, x_k)    (no autodiff graph)
//!                         free θ_k                       (each unit's inputs x_k are kept)
//! backward  for k = K−1 … 0:
//!           θ_k ← all-gather again
//!           for each micro-batch: recompute y = u_k(θ_k, x_k) with a graph; backpropagate ℓ
//!               (k = K−1) or ⟨y, g_{k+1}⟩ (the gradient from unit k+1, see `crate::pp::executor`
//!               for why that is exact); keep g_k = ∂/∂x_k; add ∂/∂θ_k to the unit's local sum
//!           reduce-scatter the local sum into the owned gradient parts; free θ_k
//! ```
//!
//! So each unit's parameters are gathered twice per step (the last unit's once) and its
//! gradients reduce-scattered once; at most one unit is whole at a time, and the activations
//! kept between forward and backward are the units' inputs (the recomputation is the price, as
//! with full activation checkpointing). Summing the micro-batches locally before reducing is
//! DDP's order, so a stage-3 step equals a DDP step bitwise. The recomputation must repeat the
//! forward exactly, so the units may not draw random numbers (the recipe refuses ZeRO 3 with
//! dropout).
//!
//! A unit's module is a skeleton: its parameters are placeholders ([`Placeholders`]) that are
//! replaced by the gathered values (`Materialize`), keeping each parameter's id, so the unit's
//! gradients are found by id in the layout.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use burn::module::{AutodiffModule, ModuleMapper, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Shape, Tensor};

use super::{ZeroError, ZeroOptimizer, ZeroStage};
use crate::device_value::fold_sum;
use crate::dp::{self, FlatTensors};
use crate::pp::{PipelineChunk, graphs_lock};

/// Replaces every float parameter by a one-element placeholder (same id, same rank): what a
/// stage-3 rank keeps of a unit between uses.
#[derive(Debug)]
pub struct Placeholders<D> {
    pub device: D,
}

impl<B: Backend> ModuleMapper<B> for Placeholders<B::Device> {
    fn map_float<const N: usize>(&mut self, param: Param<Tensor<B, N>>) -> Param<Tensor<B, N>> {
        let (id, tensor, mapper) = param.consume();
        let placeholder = Tensor::zeros(Shape::new([1; N]), &self.device);
        let placeholder = if tensor.is_require_grad() {
            placeholder.require_grad()
        } else {
            placeholder
        };
        Param::from_mapped_value(id, placeholder, mapper)
    }
}

/// Puts gathered values (flat, by id) into a skeleton's parameters, in their layout shapes; as
/// graph leaves when `leaves`.
struct Materialize<'a, B: Backend> {
    values: &'a FlatTensors<B>,
    shapes: &'a HashMap<ParamId, Vec<usize>>,
    leaves: bool,
}

impl<A: AutodiffBackend> ModuleMapper<A> for Materialize<'_, A::InnerBackend> {
    fn map_float<const N: usize>(&mut self, param: Param<Tensor<A, N>>) -> Param<Tensor<A, N>> {
        let (id, tensor, mapper) = param.consume();
        let (Some(value), Some(shape)) = (self.values.get(&id), self.shapes.get(&id)) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let value = Tensor::<A, N>::from_inner(value.clone().reshape(Shape::from(shape.clone())));
        let value = if self.leaves {
            value.require_grad()
        } else {
            value
        };
        Param::from_mapped_value(id, value, mapper)
    }
}

/// What a stage-3 step produced.
#[derive(Debug)]
pub struct ShardedStep<B: Backend> {
    /// Sum of the micro-batches' reported losses, on the device (folded in micro-batch order
    /// in its widest float; see [`crate::device_value`]).
    pub loss: Tensor<B, 1>,
    /// The owned gradient part of every bucket, under the bucket's id (what
    /// [`ZeroOptimizer::step`] takes).
    pub grads: GradientsParams,
    /// Time in all-gathers and reduce-scatters.
    pub comm: Duration,
    /// Most parameter elements whole at once.
    pub peak_gathered: usize,
}

/// A parameter that a later unit uses again under another id (a tied embedding's head copy):
/// the copy is not in the layout; it is filled from the original's gathered values, and its
/// gradient is added to the original's before the original's unit is reduced.
#[derive(Debug, Clone, Copy)]
struct Alias {
    original: ParamId,
    copy: ParamId,
    /// The unit that holds the copy.
    unit: usize,
}

impl Alias {
    /// `tied = (original, copy)`, with the unit of `units` that holds the copy.
    fn find<A: AutodiffBackend, C: AutodiffModule<A>>(
        tied: Option<(ParamId, ParamId)>,
        units: &[C],
    ) -> Result<Option<Self>, ZeroError> {
        let Some((original, copy)) = tied else {
            return Ok(None);
        };
        let unit = units
            .iter()
            .position(|u| dp::param_specs(u).iter().any(|s| s.id == copy))
            .ok_or_else(|| {
                ZeroError::State(format!("no unit holds the tied copy {copy} of {original}"))
            })?;
        Ok(Some(Self {
            original,
            copy,
            unit,
        }))
    }
}

impl<B: Backend> ZeroOptimizer<B> {
    fn shapes(&self) -> HashMap<ParamId, Vec<usize>> {
        self.layout()
            .buckets
            .iter()
            .flat_map(|b| &b.slots)
            .map(|s| (s.param.id, s.param.shape.clone()))
            .collect()
    }

    /// Unit `unit`'s parameters, gathered (with an alias's copy where the unit holds it),
    /// counting the time and the elements.
    fn gather_values(
        &self,
        unit: usize,
        alias: Option<Alias>,
        comm: &mut Duration,
        peak: &mut usize,
    ) -> Result<FlatTensors<B>, ZeroError> {
        let started = Instant::now();
        let mut values = self.gather_unit(unit)?;
        if let Some(alias) = alias.filter(|a| a.unit == unit) {
            let original = match values.get(&alias.original) {
                Some(value) => value.clone(),
                None => self
                    .gather_buckets(|b| b.slots.iter().any(|s| s.param.id == alias.original))?
                    .remove(&alias.original)
                    .ok_or_else(|| {
                        ZeroError::State(format!(
                            "the tied parameter {} is in no bucket",
                            alias.original
                        ))
                    })?,
            };
            values.insert(alias.copy, original);
        }
        *comm += started.elapsed();
        let elements: usize = values.values().map(|t| t.shape().num_elements()).sum();
        *peak = (*peak).max(elements);
        Ok(values)
    }

    /// Unit `unit` of `units` with `values`, as graph leaves when `leaves` (under the autodiff
    /// lock: making a tensor require grad registers it).
    fn materialize<A, C>(
        &self,
        unit: &C,
        values: &FlatTensors<B>,
        shapes: &HashMap<ParamId, Vec<usize>>,
        alias: Option<Alias>,
        leaves: bool,
    ) -> C
    where
        A: AutodiffBackend<InnerBackend = B>,
        C: AutodiffModule<A>,
    {
        let mut shapes = std::borrow::Cow::Borrowed(shapes);
        if let Some(alias) = alias
            && let Some(shape) = shapes.get(&alias.original).cloned()
        {
            shapes.to_mut().insert(alias.copy, shape);
        }
        unit.clone().map(&mut Materialize {
            values,
            shapes: &shapes,
            leaves,
        })
    }
}

/// One stage-3 training step of one rank over `batches` (see the module doc). `units` are the
/// skeletons, in order; the layout's buckets carry each parameter's unit. `tied = (a, b)` names
/// a parameter `a` of the layout that a later unit uses again as `b` (a tied embedding and the
/// head's copy, not in the layout): `b` is filled from `a`'s gathered values, and `a`'s
/// gradient is `Σ g_a + Σ g_b`.
pub fn run_sharded_step<A, C>(
    zero: &ZeroOptimizer<A::InnerBackend>,
    units: &[C],
    batches: &[C::Batch],
    tied: Option<(ParamId, ParamId)>,
) -> Result<ShardedStep<A::InnerBackend>, ZeroError>
where
    A: AutodiffBackend,
    C: PipelineChunk<A> + AutodiffModule<A>,
{
    if zero.stage() != ZeroStage::ShardParameters || units.is_empty() {
        return Err(ZeroError::State(format!(
            "run_sharded_step needs ZeRO stage 3 and at least one unit, not {} with {} units",
            zero.stage(),
            units.len()
        )));
    }
    let alias = Alias::find(tied, units)?;
    let shapes = zero.shapes();
    let last = units.len() - 1;
    let (mut comm, mut peak, mut losses) = (Duration::ZERO, 0, Vec::new());
    // inputs[k][mb]: unit k's input for micro-batch mb (none for the first unit).
    let mut inputs: Vec<Vec<Option<Tensor<A::InnerBackend, 3>>>> = vec![vec![None; batches.len()]];
    for unit in 0..last {
        let values = zero.gather_values(unit, alias, &mut comm, &mut peak)?;
        let _lock = graphs_lock();
        let module = zero.materialize(&units[unit], &values, &shapes, alias, false);
        let outputs = batches
            .iter()
            .zip(&inputs[unit])
            .map(|(batch, x)| {
                Some(
                    module
                        .forward(x.clone().map(Tensor::from_inner), batch)
                        .inner(),
                )
            })
            .collect();
        inputs.push(outputs);
    }
    let mut output_grads: Vec<Option<Tensor<A::InnerBackend, 3>>> = vec![None; batches.len()];
    let mut owned = HashMap::new();
    let mut copy_grad = None;
    for unit in (0..=last).rev() {
        let values = zero.gather_values(unit, alias, &mut comm, &mut peak)?;
        let mut local: FlatTensors<A::InnerBackend> = HashMap::new();
        for (mb, batch) in batches.iter().enumerate() {
            let _lock = graphs_lock();
            // Fresh leaves per micro-batch: Burn frees a graph's leaves with its backward.
            let module = zero.materialize(&units[unit], &values, &shapes, alias, true);
            let input = inputs[unit][mb]
                .take()
                .map(|x| Tensor::<A, 3>::from_inner(x).require_grad());
            let output = module.forward(input.clone(), batch);
            let scalar = match output_grads[mb].take() {
                None => {
                    let (scaled, value) = module.loss(output, batch);
                    losses.push(value.inner());
                    scaled
                }
                Some(g) => (output * Tensor::from_inner(g)).sum(),
            };
            let grads = scalar.backward();
            output_grads[mb] = input.and_then(|x| x.grad(&grads));
            let mut params = GradientsParams::from_grads(grads, &module);
            for (id, grad) in dp::take_grads(&module, &mut params) {
                let sum = match local.remove(&id) {
                    Some(previous) => previous + grad,
                    None => grad,
                };
                local.insert(id, sum);
            }
        }
        if let Some(alias) = alias {
            if let Some(grad) = local.remove(&alias.copy) {
                copy_grad = Some(grad);
            }
            if let Some(grad) = local.remove(&alias.original) {
                let copy = copy_grad.take().ok_or_else(|| {
                    ZeroError::State(format!(
                        "the tied copy's unit {} must come after its original's unit {unit}",
                        alias.unit
                    ))
                })?;
                local.insert(alias.original, grad + copy);
            }
        }
        let started = Instant::now();
        zero.reduce_unit(unit, &local, &mut owned)?;
        comm += started.elapsed();
    }
    let mut grads = GradientsParams::new();
    for (index, bucket) in zero.layout().buckets.iter().enumerate() {
        if let Some(grad) = owned.remove(&index) {
            grads.register(bucket.id, grad);
        }
    }
    Ok(ShardedStep {
        loss: fold_sum(losses, zero.device()),
        grads,
        comm,
        peak_gathered: peak,
    })
}

/// The summed loss of `batches` through the stage-3 units, forward only (evaluation): each
/// unit is gathered once for every batch. `tied` as in [`run_sharded_step`]. The loss stays on
/// the device.
pub fn run_sharded_forward<A, C>(
    zero: &ZeroOptimizer<A::InnerBackend>,
    units: &[C],
    batches: &[C::Batch],
    tied: Option<(ParamId, ParamId)>,
) -> Result<Tensor<A::InnerBackend, 1>, ZeroError>
where
    A: AutodiffBackend,
    C: PipelineChunk<A> + AutodiffModule<A>,
{
    let alias = Alias::find(tied, units)?;
    let shapes = zero.shapes();
    let (mut comm, mut peak, mut losses) = (Duration::ZERO, 0, Vec::new());
    let mut xs: Vec<Option<Tensor<A::InnerBackend, 3>>> = vec![None; batches.len()];
    for unit in 0..units.len() {
        let values = zero.gather_values(unit, alias, &mut comm, &mut peak)?;
        let _lock = graphs_lock();
        let module = zero.materialize(&units[unit], &values, &shapes, alias, false);
        for (x, batch) in xs.iter_mut().zip(batches) {
            let output = module.forward(x.take().map(Tensor::from_inner), batch);
            if unit + 1 == units.len() {
                losses.push(module.loss(output, batch).1.inner());
            } else {
                *x = Some(output.inner());
            }
        }
    }
    Ok(fold_sum(losses, zero.device()))
}

impl<B: Backend> ZeroOptimizer<B> {
    /// Reduce-scatters the local gradients `flat` of `unit`'s buckets and adds them to the
    /// owned parts accumulated in `owned` (by bucket index).
    fn reduce_unit(
        &self,
        unit: usize,
        flat: &FlatTensors<B>,
        owned: &mut HashMap<usize, Tensor<B, 1>>,
    ) -> Result<(), ZeroError> {
        for (index, bucket) in self.layout().buckets.iter().enumerate() {
            if bucket.unit != unit {
                continue;
            }
            let local = dp::flatten(bucket, flat, &self.device);
            let part = self.reduce_bucket(index, local)?;
            let sum = match owned.remove(&index) {
                Some(previous) => previous + part,
                None => part,
            };
            owned.insert(index, sum);
        }
        Ok(())
    }
}
