//! Data parallelism (DDP): every data-parallel rank holds the whole model, runs its own part of
//! the global batch, and the gradients are summed over the ranks before the optimizer step.
//!
//! **Loss normalisation.** With `N` tokens in the global batch (all ranks, all micro-batches),
//! each micro-batch backpropagates `(Σ its token losses) / N`. The sum over ranks of the local
//! gradients is then the gradient of the global mean loss,
//! `∇L = Σ_r Σ_m ∇(Σ_{t∈(r,m)} ℓ_t) / N`, which is why gradients are *summed* (not averaged)
//! here, and why a DDP run equals serial training on the concatenated batch.
//!
//! **Buckets.** Gradients travel flattened into buckets of at most `bucket_bytes` (default 25
//! MiB), filled in *reverse* registration order: backpropagation produces the last layers'
//! gradients first, so the first bucket is the first that could be sent. A bucket never mixes
//! units (FSDP units, see [`crate::fsdp`]) or matrix and vector parameters (the optimizer
//! decays only matrices), and a parameter marked `alone` gets a bucket of its own (the tied
//! embedding, whose two copies must shard identically).
//!
//! **No-sync micro-steps.** Gradients of the micro-batches of one step are accumulated locally
//! and reduced once, after the last micro-batch: nothing is communicated on the others.
//!
//! **Overlap.** The reduction follows the backward pass: nothing overlaps yet. Burn 0.21 has a
//! per-parameter hook (burn-autodiff's `distributed` feature calls
//! `DistributedBackend::submit_gradient_sync` as each gradient completes), but turning it on
//! requires every autodiff backend of the build to implement `DistributedBackend`, which
//! burn-flex does not (docs/architecture.md). [`ReduceStats`] measures the time the reduction
//! takes so its share is reported.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use wildfire_backend::comm::{CommError, ProcessGroup, ReduceOp};

/// PyTorch DDP's default bucket size.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// One parameter as the flat layout sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    pub id: ParamId,
    pub shape: Vec<usize>,
    /// FSDP unit (0 for all when the model is not wrapped in units).
    pub unit: usize,
    /// Gets a bucket of its own.
    pub alone: bool,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// A matrix (rank ≥ 2): weight decay applies to it.
    pub fn is_matrix(&self) -> bool {
        self.shape.len() >= 2
    }
}

/// A parameter's place in its bucket: elements `offset..offset + numel` of the flat bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct Slot {
    pub param: ParamSpec,
    pub offset: usize,
}

impl Slot {
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.param.numel()
    }
}

/// Parameters flattened and concatenated, in slot order.
#[derive(Debug, Clone)]
pub struct Bucket {
    /// Names the bucket's flat gradient shard in a `GradientsParams` (see `crate::fsdp`).
    pub id: ParamId,
    pub slots: Vec<Slot>,
    pub numel: usize,
    pub unit: usize,
    pub matrices: bool,
}

/// Every parameter of a model, in buckets (see the module doc for the order).
#[derive(Debug, Clone)]
pub struct FlatLayout {
    pub buckets: Vec<Bucket>,
}

impl FlatLayout {
    /// Buckets of at most `bucket_bytes` of f32 (a larger parameter gets its own) over `params`
    /// given in registration order.
    pub fn new(params: &[ParamSpec], bucket_bytes: usize) -> Self {
        let capacity = (bucket_bytes / 4).max(1);
        let mut buckets: Vec<Bucket> = Vec::new();
        for param in params.iter().rev() {
            let fits = buckets.last().is_some_and(|b: &Bucket| {
                b.unit == param.unit
                    && b.matrices == param.is_matrix()
                    && !param.alone
                    && !b.slots.iter().any(|s| s.param.alone)
                    && b.numel + param.numel() <= capacity
            });
            if !fits {
                buckets.push(Bucket {
                    id: ParamId::new(),
                    slots: Vec::new(),
                    numel: 0,
                    unit: param.unit,
                    matrices: param.is_matrix(),
                });
            }
            let bucket = buckets.last_mut().expect("a bucket was just pushed");
            bucket.slots.push(Slot {
                param: param.clone(),
                offset: bucket.numel,
            });
            bucket.numel += param.numel();
        }
        Self { buckets }
    }

    /// The layout of every float parameter of `module`, one unit, nothing alone.
    pub fn of_module<B: Backend, M: Module<B>>(module: &M, bucket_bytes: usize) -> Self {
        Self::new(&param_specs(module), bucket_bytes)
    }

    /// The layout of the float parameters of `units` (modules, in order): unit `i` is
    /// `units[i]` when `by_unit` (ZeRO 3 gathers a unit at a time), every parameter in unit 0
    /// otherwise; the parameters in `alone` get buckets of their own (a tied parameter whose
    /// gradient another rank also sums), and those in `left_out` are not in it (a copy that is
    /// gathered from its original).
    pub fn of_units<B: Backend, M: Module<B>>(
        units: &[M],
        by_unit: bool,
        alone: &[ParamId],
        left_out: &[ParamId],
        bucket_bytes: usize,
    ) -> Self {
        let specs: Vec<ParamSpec> = (units.iter().enumerate())
            .flat_map(|(index, unit)| {
                param_specs(unit).into_iter().map(move |spec| ParamSpec {
                    unit: if by_unit { index } else { 0 },
                    alone: alone.contains(&spec.id),
                    ..spec
                })
            })
            .filter(|spec| !left_out.contains(&spec.id))
            .collect();
        Self::new(&specs, bucket_bytes)
    }

    pub fn numel(&self) -> usize {
        self.buckets.iter().map(|b| b.numel).sum()
    }

    /// The layout's parameters in registration order.
    pub fn params_in_order(&self) -> Vec<&ParamSpec> {
        let mut slots: Vec<&Slot> = self.buckets.iter().flat_map(|b| &b.slots).collect();
        // Buckets fill in reverse registration order, and so do the slots within a bucket.
        slots.reverse();
        slots.iter().map(|s| &s.param).collect()
    }

    /// The ids of the layout's parameters in registration order.
    pub fn ids_in_order(&self) -> Vec<ParamId> {
        self.params_in_order().iter().map(|p| p.id).collect()
    }

    /// Whether `params` (registration order) are this layout's parameters, by id.
    pub fn matches(&self, params: &[ParamSpec]) -> bool {
        self.ids_in_order().iter().eq(params.iter().map(|p| &p.id))
    }

    /// Gives the layout's parameters the ids of `params`, the same parameters in registration
    /// order under new ids (a Burn module takes the ids of a record it loads). Errors when the
    /// count or a shape differs.
    pub fn rebind(&mut self, params: &[ParamSpec]) -> Result<(), String> {
        let old = self.ids_in_order();
        if old.len() != params.len() {
            return Err(format!(
                "the module has {} parameters, but its data-parallel layout was built for {}",
                params.len(),
                old.len()
            ));
        }
        let new: HashMap<ParamId, &ParamSpec> = old.into_iter().zip(params).collect();
        for slot in self.buckets.iter_mut().flat_map(|b| &mut b.slots) {
            let param = new[&slot.param.id];
            if param.shape != slot.param.shape {
                return Err(format!(
                    "parameter {} has shape {:?}, but its data-parallel layout was built for \
                     {:?}",
                    param.id, param.shape, slot.param.shape
                ));
            }
            slot.param.id = param.id;
        }
        Ok(())
    }

    /// Where each parameter sits: `(bucket index, slot index)`.
    pub fn index(&self) -> HashMap<ParamId, (usize, usize)> {
        let mut index = HashMap::new();
        for (b, bucket) in self.buckets.iter().enumerate() {
            for (s, slot) in bucket.slots.iter().enumerate() {
                index.insert(slot.param.id, (b, s));
            }
        }
        index
    }

    /// The slot of parameter `id`.
    pub fn slot(&self, id: ParamId) -> Option<&Slot> {
        self.buckets
            .iter()
            .flat_map(|b| &b.slots)
            .find(|s| s.param.id == id)
    }
}

/// Every float parameter of `module`, in registration order, unit 0, none alone.
pub fn param_specs<B: Backend, M: Module<B>>(module: &M) -> Vec<ParamSpec> {
    struct Specs(Vec<ParamSpec>);
    impl<B: Backend> ModuleVisitor<B> for Specs {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(ParamSpec {
                id: param.id,
                shape: param.val().dims().to_vec(),
                unit: 0,
                alone: false,
            });
        }
    }
    let mut specs = Specs(Vec::new());
    module.visit(&mut specs);
    specs.0
}

/// Flat tensors by parameter id.
pub type FlatTensors<B> = HashMap<ParamId, Tensor<B, 1>>;

/// Removes every gradient of `module`'s parameters from `grads`, flattened.
pub fn take_grads<A: AutodiffBackend, M: AutodiffModule<A>>(
    module: &M,
    grads: &mut GradientsParams,
) -> FlatTensors<A::InnerBackend> {
    struct Take<'a, B: Backend> {
        grads: &'a mut GradientsParams,
        flat: FlatTensors<B>,
    }
    impl<A: AutodiffBackend> ModuleVisitor<A> for Take<'_, A::InnerBackend> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
            if let Some(grad) = self.grads.remove::<A::InnerBackend, D>(param.id) {
                let numel = grad.shape().num_elements();
                self.flat.insert(param.id, grad.reshape([numel]));
            }
        }
    }
    let mut take = Take {
        grads,
        flat: HashMap::new(),
    };
    module.visit(&mut take);
    take.flat
}

/// Every parameter value of `module`, flattened (sharing the parameters' buffers).
pub fn flat_params<A: AutodiffBackend, M: AutodiffModule<A>>(
    module: &M,
) -> FlatTensors<A::InnerBackend> {
    struct Values<B: Backend>(FlatTensors<B>);
    impl<A: AutodiffBackend> ModuleVisitor<A> for Values<A::InnerBackend> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
            let value = param.val().inner();
            let numel = value.shape().num_elements();
            self.0.insert(param.id, value.reshape([numel]));
        }
    }
    let mut values = Values(HashMap::new());
    module.visit(&mut values);
    values.0
}

/// The bucket's flat tensor from per-parameter flat tensors (zeros for a parameter without
/// one, e.g. unused in this step).
pub fn flatten<B: Backend>(
    bucket: &Bucket,
    flat: &FlatTensors<B>,
    device: &B::Device,
) -> Tensor<B, 1> {
    let parts: Vec<Tensor<B, 1>> = bucket
        .slots
        .iter()
        .map(|slot| {
            flat.get(&slot.param.id)
                .cloned()
                .unwrap_or_else(|| Tensor::zeros([slot.param.numel()], device))
        })
        .collect();
    Tensor::cat(parts, 0)
}

/// The bucket's flat tensor cut back into per-parameter flat tensors.
pub fn unflatten<B: Backend>(bucket: &Bucket, flat: Tensor<B, 1>) -> Vec<(ParamId, Tensor<B, 1>)> {
    bucket
        .slots
        .iter()
        .map(|slot| (slot.param.id, flat.clone().slice(slot.range())))
        .collect()
}

/// Puts flat gradients back into `grads`, in the parameters' shapes.
pub fn put_grads<A: AutodiffBackend, M: AutodiffModule<A>>(
    module: &M,
    grads: &mut GradientsParams,
    mut flat: FlatTensors<A::InnerBackend>,
) {
    struct Put<'a, B: Backend> {
        grads: &'a mut GradientsParams,
        flat: &'a mut FlatTensors<B>,
    }
    impl<A: AutodiffBackend> ModuleVisitor<A> for Put<'_, A::InnerBackend> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
            if let Some(grad) = self.flat.remove(&param.id) {
                let shape: [usize; D] = param.val().dims();
                self.grads
                    .register::<A::InnerBackend, D>(param.id, grad.reshape(shape));
            }
        }
    }
    module.visit(&mut Put {
        grads,
        flat: &mut flat,
    });
}

/// Replaces the values of the parameters found in `values` (flat, by id), keeping each
/// parameter's id and whether it requires grad.
#[derive(Debug)]
pub struct SetParams<'a, B: Backend>(pub &'a FlatTensors<B>);

impl<A: AutodiffBackend> ModuleMapper<A> for SetParams<'_, A::InnerBackend> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<A, D>>) -> Param<Tensor<A, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(value) = self.0.get(&id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let mut replaced = Tensor::from_inner(value.clone().reshape(tensor.dims()));
        if tensor.is_require_grad() {
            replaced = replaced.require_grad();
        }
        Param::from_mapped_value(id, replaced, mapper)
    }
}

/// What a gradient reduction cost.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReduceStats {
    pub buckets: usize,
    /// f32 elements sent into the collectives (per rank).
    pub elements: usize,
    /// Wall time of the collectives themselves.
    pub comm: Duration,
    /// Wall time of the whole reduction (flattening and unflattening included).
    pub total: Duration,
}

/// DDP's reduction: every gradient of `module`'s parameters in `layout` summed over `group`,
/// bucket by bucket in `layout`'s order, bitwise identical on every rank (the transport sums in
/// rank order). Gradients of parameters outside `layout` are left as they are.
pub fn all_reduce_gradients<A: AutodiffBackend, M: AutodiffModule<A>>(
    group: &ProcessGroup,
    layout: &FlatLayout,
    module: &M,
    mut grads: GradientsParams,
    device: &burn::tensor::Device<A::InnerBackend>,
) -> Result<(GradientsParams, ReduceStats), CommError> {
    let started = Instant::now();
    let mut stats = ReduceStats::default();
    if group.size() == 1 {
        return Ok((grads, stats));
    }
    let mut flat = take_grads(module, &mut grads);
    let mut reduced = HashMap::with_capacity(flat.len());
    for bucket in &layout.buckets {
        let local = flatten(bucket, &flat, device);
        for slot in &bucket.slots {
            flat.remove(&slot.param.id);
        }
        let comm = Instant::now();
        let sum = group.all_reduce(local, ReduceOp::Sum)?;
        stats.comm += comm.elapsed();
        stats.buckets += 1;
        stats.elements += bucket.numel;
        reduced.extend(unflatten(bucket, sum));
    }
    reduced.extend(flat);
    put_grads(module, &mut grads, reduced);
    stats.total = started.elapsed();
    Ok((grads, stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(numel: usize, matrix: bool, unit: usize) -> ParamSpec {
        ParamSpec {
            id: ParamId::new(),
            shape: if matrix { vec![1, numel] } else { vec![numel] },
            unit,
            alone: false,
        }
    }

    #[test]
    fn buckets_fill_in_reverse_order_and_respect_the_cap() {
        let params = [
            spec(10, true, 0),
            spec(10, true, 0),
            spec(30, true, 0),
            spec(5, false, 0),
        ];
        let layout = FlatLayout::new(&params, 4 * 40);
        let ids: Vec<Vec<ParamId>> = layout
            .buckets
            .iter()
            .map(|b| b.slots.iter().map(|s| s.param.id).collect())
            .collect();
        // The vector starts (last registered), matrices never join it; 30 + 10 fits 40.
        assert_eq!(
            ids,
            [
                vec![params[3].id],
                vec![params[2].id, params[1].id],
                vec![params[0].id]
            ]
        );
        assert_eq!(layout.buckets[1].slots[1].offset, 30);
        assert_eq!(layout.numel(), 55);
    }

    #[test]
    fn units_and_lone_parameters_get_their_own_buckets() {
        let mut lone = spec(4, true, 0);
        lone.alone = true;
        let params = [spec(3, true, 0), lone.clone(), spec(3, true, 1)];
        let layout = FlatLayout::new(&params, 1 << 20);
        assert_eq!(layout.buckets.len(), 3);
        assert_eq!(layout.buckets[1].slots[0].param, lone);
        assert_eq!(layout.buckets[0].unit, 1);
    }

    /// Two Burn `Linear` layers as units: by unit, each layer's parameters are its unit's; a
    /// parameter named alone has a bucket of its own, and one left out is in none.
    #[test]
    fn modules_become_units_with_lone_and_left_out_parameters() {
        use burn::backend::Flex;
        use burn::nn::LinearConfig;

        let device = Default::default();
        let units = [
            LinearConfig::new(3, 2).init::<Flex>(&device),
            LinearConfig::new(2, 2).init::<Flex>(&device),
        ];
        let (lone, left_out) = (units[0].weight.id, units[1].weight.id);
        let unit_of = |layout: &FlatLayout| -> Vec<(ParamId, usize, bool)> {
            (layout.buckets.iter())
                .flat_map(|b| b.slots.iter().map(|s| (s.param.id, b.unit, s.param.alone)))
                .collect()
        };
        let layout = FlatLayout::of_units(&units, true, &[lone], &[left_out], 1 << 20);
        let placed = unit_of(&layout);
        assert_eq!(placed.len(), 3, "the left-out weight is in no bucket");
        assert!(!placed.iter().any(|(id, ..)| *id == left_out));
        assert!(placed.contains(&(lone, 0, true)));
        let bias = |unit: usize| units[unit].bias.as_ref().unwrap().id;
        assert!(placed.contains(&(bias(0), 0, false)));
        assert!(placed.contains(&(bias(1), 1, false)));
        let lone_bucket = layout.buckets.iter().find(|b| b.slots[0].param.id == lone);
        assert_eq!(lone_bucket.map(|b| b.slots.len()), Some(1));

        let whole = FlatLayout::of_units(&units, false, &[], &[], 1 << 20);
        assert!(
            unit_of(&whole)
                .iter()
                .all(|&(_, unit, alone)| unit == 0 && !alone)
        );
        assert_eq!(whole.numel(), 3 * 2 + 2 + 2 * 2 + 2);
    }

    #[test]
    fn a_parameter_larger_than_the_cap_gets_a_bucket() {
        let params = [spec(100, true, 0), spec(1, true, 0)];
        let layout = FlatLayout::new(&params, 8);
        assert_eq!(layout.buckets.len(), 2);
        assert_eq!(layout.buckets[1].numel, 100);
    }
}
