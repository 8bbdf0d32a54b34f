//! Parameters by name. A parameter's name is its module path with blocks numbered globally
//! (`blocks.5.attn.c_attn.weight` even on a pipeline stage whose first block is 4), which is the
//! key of checkpoints, optimizer state and weight import/export.

use burn::module::{Module, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use wildfire_backend::host_data::aligned;
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
                .push((name.to_string(), param.id, aligned(param.val().into_data())));
        }
    }
    let mut collect = Collect(Vec::new());
    for_each_param(module, first_block, &mut collect);
    collect.0
}
