//! Any module's parameters in a checkpoint under a tensor-parallel plan: each rank saves the
//! boxes of the whole tensors it holds, named by parameter path ([`ModuleLayout::slices`]), and
//! a module split by any plan loads its parts from the whole tensors the boxes join into
//! ([`super::slices::join_slices`], then [`ModuleLayout::load`]): a checkpoint saved at one
//! tensor-parallel degree loads at another.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::slices::part_slices;
use super::store::{CheckpointError, TensorSlice};
use crate::paths::{PathStack, param_shapes};
use crate::tp::TpPlan;

/// Where this rank's parameters sit in the whole module: the plan that splits it on this rank
/// and every parameter's whole shape, by path (taken from the module before the plan split it).
#[derive(Debug, Clone, PartialEq)]
pub struct ModuleLayout {
    pub plan: TpPlan,
    pub shapes: BTreeMap<String, Vec<usize>>,
}

fn invalid(name: &str, reason: String) -> CheckpointError {
    CheckpointError::InvalidSlice {
        name: name.to_string(),
        reason,
    }
}

impl ModuleLayout {
    /// The layout of `whole` (the module before `plan` splits it).
    pub fn of<B: Backend, M: Module<B>>(whole: &M, plan: TpPlan) -> Self {
        Self {
            plan,
            shapes: param_shapes(whole).into_iter().collect(),
        }
    }

    /// This rank's slices of `module` (split by the plan): its part of every split parameter,
    /// and every whole one on the first tensor-parallel rank only (the others hold copies).
    pub fn slices<B: Backend, M: Module<B>>(
        &self,
        module: &M,
    ) -> Result<Vec<TensorSlice>, CheckpointError> {
        struct Collect<'a> {
            layout: &'a ModuleLayout,
            path: PathStack,
            slices: Vec<TensorSlice>,
            error: Option<CheckpointError>,
        }
        impl<B: Backend> ModuleVisitor<B> for Collect<'_> {
            fn enter_module(&mut self, name: &str, container: &str) {
                self.path.enter(name, container);
            }
            fn exit_module(&mut self, _: &str, container: &str) {
                self.path.exit(container);
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let (path, plan) = (self.path.current(), &self.layout.plan);
                if self.error.is_some() || (plan.rank > 0 && !plan.is_split(&path, D)) {
                    return;
                }
                let Some(global) = self.layout.shapes.get(&path) else {
                    let reason = "is not in the module's layout".to_string();
                    self.error = Some(invalid(&path, reason));
                    return;
                };
                let data = param.val().into_data();
                match part_slices(plan, &path, global, path.clone(), data) {
                    Ok(slices) => self.slices.extend(slices),
                    Err(error) => self.error = Some(error),
                }
            }
        }
        let mut collect = Collect {
            layout: self,
            path: PathStack::default(),
            slices: Vec::new(),
            error: None,
        };
        module.visit(&mut collect);
        match collect.error {
            Some(error) => Err(error),
            None => Ok(collect.slices),
        }
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
            plan: &'a TpPlan,
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
                let Some(data) = self.tensors.get(&path) else {
                    return param;
                };
                let whole = Tensor::<B, D>::from_data(data.clone(), &param.lazy_device());
                let part = self.plan.local_part(&path, whole);
                param.map(|old| part.set_require_grad(old.is_require_grad()))
            }
        }
        let mut load = Load {
            plan: &self.plan,
            tensors,
            path: PathStack::default(),
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
        for (path, shape) in param_shapes(module) {
            let Some(data) = tensors.get(&path) else {
                let reason = "is missing from the checkpoint".to_string();
                return Err(invalid(&path, reason));
            };
            let part = local_shape(&self.plan, &path, &data.shape);
            if part != shape {
                let reason = format!(
                    "its checkpointed whole {:?} gives this rank a part of {part:?}, but the \
                     parameter is {shape:?}",
                    data.shape
                );
                return Err(invalid(&path, reason));
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
