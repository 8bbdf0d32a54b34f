//! Any module's parameters in a checkpoint under a tensor-parallel plan: each rank saves the
//! boxes of the whole tensors it holds, named by parameter path ([`ModuleLayout::slices`]), and
//! a module split by any plan loads its parts from the whole tensors the boxes join into
//! ([`super::slices::join_slices`], then [`ModuleLayout::load`]): a checkpoint saved at one
//! tensor-parallel degree loads at another. A pipeline stage names its parameters by their
//! paths in the whole module ([`ModuleLayout::at`]), so a checkpoint saved by stages loads into
//! any other cut, or into the whole module.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::slices::part_slices;
use super::store::{CheckpointError, TensorSlice, invalid_slice};
use crate::paths::{ParamFn, PathStack, for_each_param, param_shapes, param_shapes_at};
use crate::tp::TpPlan;

/// Where this rank's parameters sit in the whole module: the plan that splits it on this rank,
/// every parameter's whole shape, by path (taken from the module before the plan split it), and
/// how the module this rank holds names its parameters (the whole module's paths, or a pipeline
/// stage's numbered from its first block).
#[derive(Debug, Clone, PartialEq)]
pub struct ModuleLayout {
    pub plan: TpPlan,
    pub shapes: BTreeMap<String, Vec<usize>>,
    pub paths: PathStack,
    /// Parameters that copy another, by path (a tied embedding's copy on a later pipeline
    /// stage): the original's path. A copy is never stored; it loads the original's tensors.
    pub copies: BTreeMap<String, String>,
}

impl ModuleLayout {
    /// The layout of `whole` (the module before `plan` splits it).
    pub fn of<B: Backend, M: Module<B>>(whole: &M, plan: TpPlan) -> Self {
        Self {
            plan,
            shapes: param_shapes(whole).into_iter().collect(),
            paths: PathStack::default(),
            copies: BTreeMap::new(),
        }
    }

    /// This layout with parameter `copy`, which holds a copy of parameter `original` (of its
    /// shape, split by the plan's rule for `copy`), stored as `original`.
    pub fn with_copy(mut self, copy: &str, original: &str) -> Result<Self, CheckpointError> {
        let shape = self.shape(original)?.to_vec();
        self.shapes.insert(copy.to_string(), shape);
        self.copies.insert(copy.to_string(), original.to_string());
        Ok(self)
    }

    /// The path parameter `path` is stored under: its original's for a copy, its own otherwise.
    pub fn stored_path<'a>(&'a self, path: &'a str) -> &'a str {
        self.copies.get(path).map_or(path, String::as_str)
    }

    /// This layout for a part of the whole module whose parameters `paths` names by their
    /// paths in the whole (a pipeline stage: [`PathStack::numbered_from`]).
    pub fn at(self, paths: PathStack) -> Self {
        Self { paths, ..self }
    }

    /// The whole shape of parameter `path`.
    pub fn shape(&self, path: &str) -> Result<&[usize], CheckpointError> {
        let reason = || "is not in the module's layout".to_string();
        (self.shapes.get(path).map(Vec::as_slice)).ok_or_else(|| invalid_slice(path, reason()))
    }

    /// Whether this rank stores parameter `path` (and its optimizer state): its part of a split
    /// one, and a whole one or a part other ranks hold too only on the first of those ranks
    /// ([`TpPlan::holds_first_copy`]); never a copy of another parameter ([`Self::with_copy`]).
    pub fn stores(&self, path: &str) -> Result<bool, CheckpointError> {
        let dims = self.shape(path)?.len();
        let copy = self.copies.contains_key(path);
        Ok(!copy && self.plan.holds_first_copy(path, dims))
    }

    /// This rank's part `data` of parameter `path` as the slices stored under `stored` (the
    /// parameter's path, or a name of its optimizer state): its boxes of the whole tensor.
    pub fn param_slices(
        &self,
        path: &str,
        stored: String,
        data: TensorData,
    ) -> Result<Vec<TensorSlice>, CheckpointError> {
        part_slices(&self.plan, path, self.shape(path)?, stored, data)
    }

    /// This rank's slices of `module` (split by the plan): those of every parameter it
    /// [stores](Self::stores).
    pub fn slices<B: Backend, M: Module<B>>(
        &self,
        module: &M,
    ) -> Result<Vec<TensorSlice>, CheckpointError> {
        struct Collect<'a> {
            layout: &'a ModuleLayout,
            slices: Result<Vec<TensorSlice>, CheckpointError>,
        }
        impl<B: Backend> ParamFn<B> for Collect<'_> {
            fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
                let Ok(slices) = &mut self.slices else {
                    return;
                };
                let data = || param.val().into_data();
                let stored = match self.layout.stores(path) {
                    Ok(true) => self.layout.param_slices(path, path.to_string(), data()),
                    Ok(false) => Ok(Vec::new()),
                    Err(error) => Err(error),
                };
                match stored {
                    Ok(stored) => slices.extend(stored),
                    Err(error) => self.slices = Err(error),
                }
            }
        }
        let mut collect = Collect {
            layout: self,
            slices: Ok(Vec::new()),
        };
        for_each_param(module, self.paths.clone(), &mut collect);
        collect.slices
    }

    /// The whole (unsplit) `module` with every parameter from `tensors` (by path, ids kept):
    /// [`Self::load`] at [`TpPlan::serial`]. How a checkpoint, another format's weights or the
    /// same module's values on another backend ([`crate::paths::param_values`]) load.
    pub fn load_whole<B: Backend, M: Module<B>>(
        module: M,
        tensors: &BTreeMap<String, TensorData>,
    ) -> Result<M, CheckpointError> {
        Self::of(&module, TpPlan::serial()).load(module, tensors)
    }

    /// `module` (split by this layout's plan) with every parameter from `tensors` (whole, by
    /// path): this rank's part of it under the plan, in the parameter's id. Refused before
    /// anything is loaded, naming the parameter: one `tensors` lacks, or a whole tensor whose
    /// part under the plan is not the parameter's shape.
    pub fn load<B: Backend, M: Module<B>>(
        &self,
        module: M,
        tensors: &BTreeMap<String, TensorData>,
    ) -> Result<M, CheckpointError> {
        self.check_load(&module, tensors)?;
        struct Load<'a> {
            layout: &'a ModuleLayout,
            tensors: &'a BTreeMap<String, TensorData>,
            path: PathStack,
        }
        impl<B: Backend> ModuleMapper<B> for Load<'_> {
            fn enter_module(&mut self, name: &str, container: &str) {
                self.path.enter(name, container);
            }
            fn exit_module(&mut self, _: &str, container: &str) {
                self.path.exit(container);
            }
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<B, D>>,
            ) -> Param<Tensor<B, D>> {
                let path = self.path.current();
                let Some(data) = self.tensors.get(self.layout.stored_path(&path)) else {
                    return param;
                };
                let whole = Tensor::<B, D>::from_data(data.clone(), &param.lazy_device());
                let part = self.layout.plan.local_part(&path, whole);
                param.map(|old| part.set_require_grad(old.is_require_grad()))
            }
        }
        let mut load = Load {
            layout: self,
            tensors,
            path: self.paths.clone(),
        };
        Ok(module.map(&mut load))
    }

    /// Whether every parameter of `module` is in `tensors`, its part under the plan in the
    /// parameter's shape.
    fn check_load<B: Backend, M: Module<B>>(
        &self,
        module: &M,
        tensors: &BTreeMap<String, TensorData>,
    ) -> Result<(), CheckpointError> {
        for (path, shape) in param_shapes_at(module, self.paths.clone()) {
            let Some(data) = tensors.get(self.stored_path(&path)) else {
                let reason = "is missing from the checkpoint".to_string();
                return Err(invalid_slice(&path, reason));
            };
            let part = local_shape(&self.plan, &path, &data.shape);
            if part != shape {
                let reason = format!(
                    "its checkpointed whole {:?} gives this rank a part of {part:?}, but the \
                     parameter is {shape:?}",
                    data.shape.to_vec()
                );
                return Err(invalid_slice(&path, reason));
            }
        }
        Ok(())
    }
}

/// The shape of rank `plan.rank`'s part of the whole tensor `path` of shape `global`: its boxes
/// joined along the split dimension.
fn local_shape(plan: &TpPlan, path: &str, global: &[usize]) -> Vec<usize> {
    let Some(dim) = plan.split_dim(path, global.len()) else {
        return global.to_vec();
    };
    let mut shape = global.to_vec();
    shape[dim] = plan.boxes(path, global).iter().map(|b| b.shape[dim]).sum();
    shape
}
