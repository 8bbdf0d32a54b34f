//! Identical replicas: every data-parallel rank must start from the same parameters, or the
//! ranks silently train different models (their gradients are summed as if they were one).
//!
//! Two ways to get there, both collective over the data-parallel group:
//! - [`broadcast_parameters`] makes every rank's parameters those of data-parallel rank 0, in
//!   registration order; a rank may have drawn anything before (another seed, or Burn's lazy
//!   initialisation, which draws a parameter when it is first read and so in whatever order
//!   the threads of one process happen to read them).
//! - [`verify_replicas`] compares a checksum of every parameter's bits over the ranks and fails
//!   naming the first parameter (by its path in the module) that differs, and the ranks.
//!
//! Reading a parameter initialises it, so both work on lazily initialised modules.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use wildfire_backend::comm::{CommError, ProcessGroup, fnv1a};

/// Why the replicas could not be made or found identical.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(
        "data-parallel rank {rank} starts from a different `{path}` than rank 0 (parameter {index} \
         of {count} in registration order, shape {shape:?}; checksums {theirs:016x} and \
         {first:016x}): every replica must start from the same parameters; broadcast them from \
         rank 0 (`replicas::broadcast_parameters`) or draw them from the same seed"
    )]
    Differs {
        path: String,
        index: usize,
        count: usize,
        shape: Vec<usize>,
        rank: usize,
        theirs: u64,
        first: u64,
    },
}

/// Every float parameter of a module: its path (`encoder.0.weight`), id and shape, in
/// registration order.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedParam {
    pub path: String,
    pub id: ParamId,
    pub shape: Vec<usize>,
}

/// The float parameters of `module` with their paths, in registration order.
pub fn named_params<B: Backend, M: Module<B>>(module: &M) -> Vec<NamedParam> {
    struct Names {
        stack: Vec<String>,
        found: Vec<NamedParam>,
    }
    impl<B: Backend> ModuleVisitor<B> for Names {
        fn enter_module(&mut self, name: &str, _container: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.found.push(NamedParam {
                path: self.stack.join("."),
                id: param.id,
                shape: param.val().dims().to_vec(),
            });
        }
    }
    let mut names = Names {
        stack: Vec::new(),
        found: Vec::new(),
    };
    module.visit(&mut names);
    names.found
}

/// Every float parameter's value, in registration order (reading initialises a lazy one).
fn values<B: Backend, M: Module<B>>(module: &M) -> Vec<(ParamId, Tensor<B, 1>)> {
    struct Values<B: Backend>(Vec<(ParamId, Tensor<B, 1>)>);
    impl<B: Backend> ModuleVisitor<B> for Values<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            let numel = value.shape().num_elements();
            self.0.push((param.id, value.reshape([numel])));
        }
    }
    let mut values = Values(Vec::new());
    module.visit(&mut values);
    values.0
}

/// `module` with every float parameter replaced by data-parallel rank 0's (`group` is the
/// data-parallel group), keeping each parameter's id and whether it requires grad. Every rank
/// of `group` calls it with a module of the same structure.
///
/// The broadcasts take no lock; the new parameters are made under the autodiff graph lock
/// ([`crate::pp::graphs_lock`], which the caller must not hold), as thread ranks need.
pub fn broadcast_parameters<B: Backend, M: Module<B>>(
    module: M,
    group: &ProcessGroup,
) -> Result<M, ReplicaError> {
    if group.size() == 1 {
        return Ok(module);
    }
    let mut received = Vec::new();
    for (id, value) in values(&module) {
        received.push((id, group.broadcast(value.detach(), 0)?));
    }
    Ok(replace_values(module, received))
}

/// `module` with the values of `values` (flat, by id) in its parameters.
pub(crate) fn replace_values<B: Backend, M: Module<B>>(
    module: M,
    values: Vec<(ParamId, Tensor<B, 1>)>,
) -> M {
    struct Replace<B: Backend>(std::collections::HashMap<ParamId, Tensor<B, 1>>);
    impl<B: Backend> ModuleMapper<B> for Replace<B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let Some(value) = self.0.remove(&id) else {
                return Param::from_mapped_value(id, tensor, mapper);
            };
            let mut value = value.reshape(tensor.dims());
            if tensor.is_require_grad() {
                value = value.require_grad();
            }
            Param::from_mapped_value(id, value, mapper)
        }
    }
    let _lock = crate::pp::graphs_lock();
    module.map(&mut Replace(values.into_iter().collect()))
}

/// Checks that every rank of `group` (the data-parallel group) holds bitwise the same
/// parameters, comparing one checksum per parameter; the error names the first parameter that
/// differs and the first rank that differs from rank 0 in it.
pub fn verify_replicas<B: Backend, M: Module<B>>(
    module: &M,
    group: &ProcessGroup,
) -> Result<(), ReplicaError> {
    if group.size() == 1 {
        return Ok(());
    }
    let names = named_params(module);
    let mine: Vec<f64> = values(module)
        .into_iter()
        .flat_map(|(_, value)| {
            let hash = fnv1a(value.into_data().as_bytes().iter().copied());
            // Two halves, each exact in f64.
            [(hash >> 32) as f64, (hash & 0xffff_ffff) as f64]
        })
        .collect();
    let count = names.len();
    let hashes: Vec<Vec<u64>> = (group.all_gather_values(&mine)?.iter())
        .map(|rank| {
            rank.chunks(2)
                .map(|pair| ((pair[0] as u64) << 32) | pair[1] as u64)
                .collect()
        })
        .collect();
    for (index, param) in names.into_iter().enumerate() {
        let first = hashes[0][index];
        if let Some(rank) = hashes.iter().position(|h| h[index] != first) {
            return Err(ReplicaError::Differs {
                path: param.path,
                index,
                count,
                shape: param.shape,
                rank,
                theirs: hashes[rank][index],
                first,
            });
        }
    }
    Ok(())
}
