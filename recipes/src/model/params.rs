//! Parameters by name. A parameter's name is its module path with blocks numbered globally
//! (`blocks.5.attn.c_attn.weight` even on a pipeline stage whose first block is 4), which is the
//! key of checkpoints, optimizer state and weight import/export.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use wildfire_parallel::paths::{self, PathStack};

pub use wildfire_parallel::paths::ParamFn;

/// The paths of a stage whose first block is `first_block` of the whole model: blocks numbered
/// globally.
pub fn global_paths(first_block: usize) -> PathStack {
    PathStack::numbered_from("blocks", first_block)
}

/// Calls `f` on every float parameter of `module` with its global name, in module order.
pub fn for_each_param<B: Backend, M: Module<B>, F: ParamFn<B>>(
    module: &M,
    first_block: usize,
    f: &mut F,
) {
    paths::for_each_param(module, global_paths(first_block), f);
}

/// Every float parameter as `(name, id, data)`, in module order.
pub fn collect_params<B: Backend, M: Module<B>>(
    module: &M,
    first_block: usize,
) -> Vec<(String, ParamId, TensorData)> {
    struct Collect(Vec<(String, ParamId, TensorData)>);
    impl<B: Backend> ParamFn<B> for Collect {
        fn visit<const D: usize>(&mut self, name: &str, param: &Param<Tensor<B, D>>) {
            self.0
                .push((name.to_string(), param.id, param.val().into_data()));
        }
    }
    let mut collect = Collect(Vec::new());
    for_each_param(module, first_block, &mut collect);
    collect.0
}

/// The global names of every float parameter, in module order.
pub fn param_names<B: Backend, M: Module<B>>(module: &M, first_block: usize) -> Vec<String> {
    struct Names(Vec<String>);
    impl<B: Backend> ParamFn<B> for Names {
        fn visit<const D: usize>(&mut self, name: &str, _: &Param<Tensor<B, D>>) {
            self.0.push(name.to_string());
        }
    }
    let mut names = Names(Vec::new());
    for_each_param(module, first_block, &mut names);
    names.0
}

/// Why a set of named tensors does not fit a module.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LoadError {
    #[error("parameter {name} is missing from {origin}")]
    Missing { name: String, origin: String },
    #[error("parameter {name} has shape {found:?} in {origin}, the model expects {expected:?}")]
    Shape {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
        origin: String,
    },
    #[error("{origin} holds tensors the model does not have: {names}")]
    Unexpected { names: String, origin: String },
}

/// Replaces every float parameter's value by the tensor of the same name, keeping parameter ids
/// (so optimizer state keyed by id stays attached). `source` names the origin in errors. Every
/// parameter must be present with its shape, and every tensor must be used.
pub fn load_params<B: Backend, M: Module<B>>(
    module: M,
    first_block: usize,
    mut tensors: BTreeMap<String, TensorData>,
    source: &str,
) -> Result<M, LoadError> {
    struct Load<'a> {
        path: PathStack,
        tensors: &'a mut BTreeMap<String, TensorData>,
        source: &'a str,
        error: Option<LoadError>,
    }
    impl<B: Backend> ModuleMapper<B> for Load<'_> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.path.enter(name, container);
        }
        fn exit_module(&mut self, _name: &str, container: &str) {
            self.path.exit(container);
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let name = self.path.current();
            let expected = tensor.dims().to_vec();
            let replacement = match self.tensors.remove(&name) {
                None => Err(LoadError::Missing {
                    name,
                    origin: self.source.to_string(),
                }),
                Some(data) if data.shape.as_slice() != expected.as_slice() => {
                    Err(LoadError::Shape {
                        name,
                        found: data.shape.to_vec(),
                        expected,
                        origin: self.source.to_string(),
                    })
                }
                Some(data) => Ok(data),
            };
            let tensor = match replacement {
                Ok(data) => {
                    let loaded =
                        Tensor::from_data(data.convert_dtype(tensor.dtype()), &tensor.device());
                    if tensor.is_require_grad() {
                        loaded.require_grad()
                    } else {
                        loaded
                    }
                }
                Err(error) => {
                    self.error.get_or_insert(error);
                    tensor
                }
            };
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    let mut load = Load {
        path: global_paths(first_block),
        tensors: &mut tensors,
        source,
        error: None,
    };
    let module = module.map(&mut load);
    if let Some(error) = load.error {
        return Err(error);
    }
    if !tensors.is_empty() {
        let names: Vec<&str> = tensors.keys().map(String::as_str).collect();
        return Err(LoadError::Unexpected {
            names: names.join(", "),
            origin: source.to_string(),
        });
    }
    Ok(module)
}
