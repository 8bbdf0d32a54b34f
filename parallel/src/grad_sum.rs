//! Gradients summed over a process group in place, in a `GradientsParams`: the sequence-partial
//! parameters of tensor parallelism ([`crate::tp::SequencePartial`]) and parameters tied across
//! pipeline stages ([`crate::pp::TiedCopies`]).

use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use wildfire_backend::comm::{CommError, ProcessGroup, ReduceOp};

/// Why a gradient sum failed.
#[derive(Debug, thiserror::Error)]
pub enum GradSumError {
    #[error("parameter {id} has its gradient summed over a group but has no gradient")]
    Missing { id: ParamId },
    #[error("a parameter of rank {0} has its gradient summed over a group: ranks 1 to 4 can")]
    Rank(usize),
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// Replaces the gradient of parameter `id` (of rank `D`, on backend `B`: an autodiff backend's
/// inner one) by its sum over `group`.
pub fn all_reduce_gradient<B: Backend, const D: usize>(
    grads: &mut GradientsParams,
    id: ParamId,
    group: &ProcessGroup,
) -> Result<(), GradSumError> {
    let grad = grads
        .remove::<B, D>(id)
        .ok_or(GradSumError::Missing { id })?;
    grads.register(id, group.all_reduce(grad, ReduceOp::Sum)?);
    Ok(())
}

/// [`all_reduce_gradient`] for a parameter of rank `dims`.
pub fn all_reduce_gradient_of_rank<B: Backend>(
    grads: &mut GradientsParams,
    id: ParamId,
    dims: usize,
    group: &ProcessGroup,
) -> Result<(), GradSumError> {
    match dims {
        1 => all_reduce_gradient::<B, 1>(grads, id, group),
        2 => all_reduce_gradient::<B, 2>(grads, id, group),
        3 => all_reduce_gradient::<B, 3>(grads, id, group),
        4 => all_reduce_gradient::<B, 4>(grads, id, group),
        _ => Err(GradSumError::Rank(dims)),
    }
}
