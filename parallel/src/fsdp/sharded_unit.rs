//! ZeRO 3 for any Burn model: the parts of a model wrapped in [`ShardedUnit`] keep only their
//! own rows of every parameter between uses, and are whole only while their forward runs, and
//! again while their backward needs them.
//!
//! **Sharding.** Each parameter of a unit is split along its first dimension over the `p`
//! data-parallel ranks by the uneven-split rule (rank `r` keeps rows `split_ranges(n, p)[r]`),
//! keeping its id: the parameter *is* its shard, so any Burn optimizer steps it (elementwise
//! optimizers such as AdamW then do exactly what they do to the same rows of the whole
//! parameter), and burn-train's records hold each rank's rows.
//!
//! **The gather.** Burn has no forward hooks, so the unit's forward is the trigger: the user
//! writes `unit.forward(x, |block, x| block.forward(x))`, and inside the scope that the strategy
//! opens around training ([`gather_units_within`]) the unit all-gathers its parameters first:
//!
//! ```text
//! forward    θ = all_gather(θ_r)           (a memory-bound autodiff node, output not kept)
//!            y = block(θ, x)               θ dropped when the closure returns
//! backward   θ = all_gather(θ_r) again     (Burn's BalancedCheckpointing recomputes the node
//!                                            when a later node's backward reads it)
//!            ∂L/∂θ_r = part r of Σ_q ∂L_q/∂θ   (the gather's adjoint: reduce-scatter)
//! ```
//!
//! So a unit's whole parameters live only while its forward runs and while its backward reads
//! them; its gradient reaches the optimizer already summed over the ranks and cut to this
//! rank's rows, reduce-scattered as soon as the backward pass is back at the unit's input `x`
//! (the gathers hang from `x` in the graph: see `all_gather_recomputed`). The recomputation needs `Autodiff<Parallel<B>, BalancedCheckpointing>`:
//! Burn's default `NoCheckpointing` keeps every gathered parameter until the backward pass (the
//! strategy refuses it). Every rank must run the same units in the same order, forward and
//! backward: the gathers are collectives.
//!
//! **Why a scope.** A unit learns the group from the thread it runs on, not from a field: Burn's
//! module mappers, the only generic way into a user's model, can change parameters but not
//! other fields. Outside a scope a unit is its module, as at one rank.

use std::cell::RefCell;
use std::collections::HashSet;
use std::marker::PhantomData;

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};
use wildfire_backend::collective::CollectiveBackend;
use wildfire_backend::comm::{CommError, ProcessGroup, split_ranges};

use crate::pp::graphs_lock;

/// How burn's derive names this type to module visitors (`enter_module`'s container).
const CONTAINER: &str = "Struct:ShardedUnit";

/// A part of a model that ZeRO 3 shards as one unit (see the module doc). At ZeRO 0–2, and at
/// one rank, it is its module.
#[derive(Module, Debug)]
pub struct ShardedUnit<B: Backend, M> {
    module: M,
    _backend: PhantomData<B>,
}

impl<B: Backend, M: Module<B>> ShardedUnit<B, M> {
    pub fn new(module: M) -> Self {
        Self {
            module,
            _backend: PhantomData,
        }
    }

    /// `f` on the whole module and the unit's input `x`: inside [`gather_units_within`] the
    /// module's parameters are all-gathered first (and dropped when `f` returns); outside, `f`
    /// runs on the module as it is.
    ///
    /// Panics when a gather fails (a forward cannot return the error; the job cannot go on).
    pub fn forward<const D: usize, O>(
        &self,
        x: Tensor<B, D>,
        f: impl FnOnce(&M, Tensor<B, D>) -> O,
    ) -> O
    where
        B: CollectiveBackend,
    {
        let Some(group) = SCOPE.with(|scope| scope.borrow().clone()) else {
            return f(&self.module, x);
        };
        let mut gather = GatherRows {
            group: &group,
            after: x.clone().into_primitive().tensor(),
            error: None,
        };
        let whole = self.module.clone().map(&mut gather);
        if let Some(error) = gather.error {
            panic!("ZeRO 3: gathering a unit's parameters failed: {error}");
        }
        f(&whole, x)
    }
}

thread_local! {
    /// The data-parallel group of the ZeRO 3 scope open on this thread.
    static SCOPE: RefCell<Option<ProcessGroup>> = const { RefCell::new(None) };
}

/// While alive, every [`ShardedUnit`] run on this thread gathers over its group; dropping it
/// restores the scope that was open before.
#[derive(Debug)]
#[must_use = "units gather only while the scope is alive"]
pub struct GatherScope {
    previous: Option<ProcessGroup>,
}

/// Opens a ZeRO 3 scope over the data-parallel `group` on this thread.
pub fn gather_units_within(group: &ProcessGroup) -> GatherScope {
    let previous = SCOPE.with(|scope| scope.replace(Some(group.clone())));
    GatherScope { previous }
}

impl Drop for GatherScope {
    fn drop(&mut self) {
        let previous = self.previous.take();
        SCOPE.with(|scope| *scope.borrow_mut() = previous);
    }
}

/// Why a model cannot be sharded by its units.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("ZeRO 3 found no ShardedUnit in the model: wrap the blocks to shard in one")]
    NoUnits,
    #[error(
        "ZeRO 3 splits a unit's parameters by their first dimension, and `{path}` (shape \
         {shape:?}) has {rows} rows, fewer than the {ranks} data-parallel ranks"
    )]
    TooFewRows {
        path: String,
        shape: Vec<usize>,
        rows: usize,
        ranks: usize,
    },
    #[error(
        "ZeRO 3 by units needs a backend whose backward pass gathers a unit's parameters again \
         instead of keeping them: Autodiff<Parallel<B>, BalancedCheckpointing> (Burn's default \
         NoCheckpointing keeps them all)"
    )]
    KeepsGathers,
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// Tracks whether a visitor or mapper is inside a [`ShardedUnit`], and the path it is at.
#[derive(Debug, Default)]
struct Within {
    units: usize,
    path: Vec<String>,
}

impl Within {
    fn enter(&mut self, name: &str, container: &str) {
        self.units += usize::from(container == CONTAINER);
        self.path.push(name.to_string());
    }

    fn exit(&mut self, container: &str) {
        self.units -= usize::from(container == CONTAINER);
        self.path.pop();
    }

    fn in_unit(&self) -> bool {
        self.units > 0
    }

    /// The path of a parameter of the current module (burn's naming: the parameter's field is
    /// the last name entered).
    fn path(&self) -> String {
        self.path.join(".")
    }
}

/// The ids of every parameter inside a [`ShardedUnit`] of `module`.
pub fn unit_params<B: Backend, M: Module<B>>(module: &M) -> HashSet<ParamId> {
    struct Ids {
        within: Within,
        ids: HashSet<ParamId>,
    }
    impl<B: Backend> ModuleVisitor<B> for Ids {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.within.enter(name, container);
        }
        fn exit_module(&mut self, _name: &str, container: &str) {
            self.within.exit(container);
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.within.in_unit() {
                self.ids.insert(param.id);
            }
        }
    }
    let mut ids = Ids {
        within: Within::default(),
        ids: HashSet::new(),
    };
    module.visit(&mut ids);
    ids.ids
}

/// `module` with every parameter inside a [`ShardedUnit`] cut to this rank's rows of the
/// data-parallel `group` (ids kept; the parameters outside units stay whole). Every rank must
/// hold the same model (see `crate::replicas`).
pub fn shard_units<A: AutodiffBackend, M: AutodiffModule<A>>(
    module: M,
    group: &ProcessGroup,
) -> Result<M, ShardError> {
    struct KeepRows<'a>(&'a ProcessGroup);
    impl<B: Backend> RowMap<B> for KeepRows<'_> {
        fn map<const D: usize>(
            &mut self,
            path: &str,
            whole: Tensor<B, D>,
        ) -> Result<Tensor<B, D>, ShardError> {
            let (shape, ranks) = (whole.dims().to_vec(), self.0.size());
            if shape[0] < ranks {
                return Err(ShardError::TooFewRows {
                    path: path.to_string(),
                    rows: shape[0],
                    shape,
                    ranks,
                });
            }
            let rows = split_ranges(shape[0], ranks)[self.0.rank()].clone();
            // A copy of the rows: a slice may keep its whole source alive.
            Ok(whole.narrow(0, rows.start, rows.len()).mul_scalar(1.0))
        }
    }
    match map_unit_params(module, KeepRows(group))? {
        (_, 0) => Err(ShardError::NoUnits),
        (module, _) => Ok(module),
    }
}

/// `module` with every parameter inside a [`ShardedUnit`] whole again (the inverse of
/// [`shard_units`], all-gathered over `group`): for checkpoints and for the trained model.
pub fn gather_units<A, M>(module: M, group: &ProcessGroup) -> Result<M, ShardError>
where
    A: AutodiffBackend,
    A::InnerBackend: CollectiveBackend,
    M: AutodiffModule<A>,
{
    struct WholeRows<'a>(&'a ProcessGroup);
    impl<B: CollectiveBackend> RowMap<B> for WholeRows<'_> {
        fn map<const D: usize>(
            &mut self,
            _path: &str,
            rows: Tensor<B, D>,
        ) -> Result<Tensor<B, D>, ShardError> {
            let whole = B::comm_all_gather(rows.into_primitive().tensor(), self.0, 0)?;
            Ok(Tensor::from_primitive(TensorPrimitive::Float(whole)))
        }
    }
    map_unit_params(module, WholeRows(group)).map(|(module, _)| module)
}

/// Reduce-scatters the gradients of `module`'s unit parameters, computed on the units whole,
/// to this rank's rows over the data-parallel `group` (the collective and fold order of the
/// reduce-scatter that ZeRO 3's gather runs in the backward pass): for thread ranks, which
/// compute on whole units because they cannot communicate inside a backward pass. `module`
/// holds the rows, under the same ids.
pub fn reduce_scatter_unit_grads<A, M>(
    module: &M,
    grads: &mut GradientsParams,
    group: &ProcessGroup,
) -> Result<(), ShardError>
where
    A: AutodiffBackend,
    A::InnerBackend: CollectiveBackend,
    M: AutodiffModule<A>,
{
    struct Scatter<'a> {
        units: HashSet<ParamId>,
        grads: &'a mut GradientsParams,
        group: &'a ProcessGroup,
        error: Option<CommError>,
    }
    impl<A: AutodiffBackend> ModuleVisitor<A> for Scatter<'_>
    where
        A::InnerBackend: CollectiveBackend,
    {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
            if !self.units.contains(&param.id) || self.error.is_some() {
                return;
            }
            let Some(whole) = self.grads.remove::<A::InnerBackend, D>(param.id) else {
                return;
            };
            let primitive = whole.into_primitive().tensor();
            match A::InnerBackend::comm_reduce_scatter(primitive, self.group, 0) {
                Ok(rows) => {
                    let rows = Tensor::from_primitive(TensorPrimitive::Float(rows));
                    self.grads.register::<A::InnerBackend, D>(param.id, rows);
                }
                Err(error) => self.error = Some(error),
            }
        }
    }
    let mut scatter = Scatter {
        units: unit_params(module),
        grads,
        group,
        error: None,
    };
    module.visit(&mut scatter);
    match scatter.error {
        Some(error) => Err(error.into()),
        None => Ok(()),
    }
}

/// What [`map_unit_params`] does to each parameter inside a unit, outside the autodiff graph
/// (a trait, not a closure: it is generic over the tensor's rank).
trait RowMap<B: Backend> {
    fn map<const D: usize>(
        &mut self,
        path: &str,
        value: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, ShardError>;
}

/// `module` with `map` applied to the value of every parameter inside a [`ShardedUnit`] (each
/// becomes a new graph leaf that requires grad as before), and how many it mapped; the first
/// error stops it. `map` runs on every value first, outside any lock (it may communicate, and
/// thread ranks must not hold the autodiff lock while they wait for each other); the new leaves
/// are then made under the lock.
fn map_unit_params<A, M, R>(module: M, map: R) -> Result<(M, usize), ShardError>
where
    A: AutodiffBackend,
    M: AutodiffModule<A>,
    R: RowMap<A::InnerBackend>,
{
    struct MapValues<R, B: Backend> {
        map: R,
        within: Within,
        values: Vec<FloatTensor<B>>,
        error: Option<ShardError>,
    }
    impl<A: AutodiffBackend, R: RowMap<A::InnerBackend>> ModuleVisitor<A>
        for MapValues<R, A::InnerBackend>
    {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.within.enter(name, container);
        }
        fn exit_module(&mut self, _name: &str, container: &str) {
            self.within.exit(container);
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<A, D>>) {
            if !self.within.in_unit() || self.error.is_some() {
                return;
            }
            match self.map.map(&self.within.path(), param.val().inner()) {
                Ok(value) => self.values.push(value.into_primitive().tensor()),
                Err(error) => self.error = Some(error),
            }
        }
    }
    /// Puts the mapped values into the unit parameters, in the same visiting order.
    struct PutValues<P> {
        values: std::vec::IntoIter<P>,
        within: Within,
    }
    impl<A: AutodiffBackend> ModuleMapper<A> for PutValues<FloatTensor<A::InnerBackend>> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.within.enter(name, container);
        }
        fn exit_module(&mut self, _name: &str, container: &str) {
            self.within.exit(container);
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<A, D>>) -> Param<Tensor<A, D>> {
            if !self.within.in_unit() {
                return param;
            }
            let (id, tensor, mapper) = param.consume();
            let value = self
                .values
                .next()
                .expect("one mapped value per unit parameter");
            let value = Tensor::<A::InnerBackend, D>::from_primitive(TensorPrimitive::Float(value));
            let value = Tensor::from_inner(value).set_require_grad(tensor.is_require_grad());
            Param::from_mapped_value(id, value, mapper)
        }
    }
    let mut mapped = MapValues {
        map,
        within: Within::default(),
        values: Vec::new(),
        error: None,
    };
    module.visit(&mut mapped);
    if let Some(error) = mapped.error {
        return Err(error);
    }
    let count = mapped.values.len();
    let mut put = PutValues {
        values: mapped.values.into_iter(),
        within: Within::default(),
    };
    let _lock = graphs_lock();
    Ok((module.map(&mut put), count))
}

/// All-gathers every parameter it maps (a unit's, in [`ShardedUnit::forward`]), as a node whose
/// output the backward pass gathers again, placed after the unit's input `after`.
struct GatherRows<'a, B: Backend> {
    group: &'a ProcessGroup,
    after: FloatTensor<B>,
    error: Option<CommError>,
}

impl<B: CollectiveBackend> ModuleMapper<B> for GatherRows<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if self.error.is_some() {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        let rows = tensor.clone().into_primitive().tensor();
        match B::comm_all_gather_recomputed(rows, self.group, 0, &self.after) {
            Ok(whole) => {
                let whole = Tensor::from_primitive(TensorPrimitive::Float(whole));
                Param::from_mapped_value(id, whole, mapper)
            }
            Err(error) => {
                self.error = Some(error);
                Param::from_mapped_value(id, tensor, mapper)
            }
        }
    }
}
