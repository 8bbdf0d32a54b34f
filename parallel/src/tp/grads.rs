//! Gradients a tensor-parallel group sums: under sequence parallelism each rank applies the
//! parameters it holds whole inside the sequence-parallel region (norms, a row-parallel
//! layer's bias) to its part of the sequence only, so its gradient is the sum over its
//! positions; the parameter's gradient is the sum over all of them, over the group.

use burn::module::{Module, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use wildfire_backend::comm::ProcessGroup;

use super::plan::TpPlan;
use crate::grad_sum::{GradSumError, all_reduce_gradient_of_rank};
use crate::paths::{ParamFn, PathStack, for_each_param};

/// The parameters whose gradients the tensor-parallel group sums ([`TpPlan::is_sequence_partial`]),
/// as `(id, rank)`; none without sequence parallelism.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SequencePartial {
    params: Vec<(ParamId, usize)>,
}

impl SequencePartial {
    /// The given parameters, `(id, rank)`.
    pub fn new(params: Vec<(ParamId, usize)>) -> Self {
        Self { params }
    }

    /// The parameters of `module` (already split by `plan`) that `plan` makes sequence-partial.
    pub fn of<B: Backend, M: Module<B>>(module: &M, plan: &TpPlan) -> Self {
        struct Select<'a> {
            plan: &'a TpPlan,
            params: Vec<(ParamId, usize)>,
        }
        impl<B: Backend> ParamFn<B> for Select<'_> {
            fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
                if self.plan.is_sequence_partial(path, D) {
                    self.params.push((param.id, D));
                }
            }
        }
        let mut select = Select {
            plan,
            params: Vec::new(),
        };
        for_each_param(module, PathStack::default(), &mut select);
        Self::new(select.params)
    }

    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// Replaces each parameter's gradient in `grads` (on backend `B`, the autodiff backend's
    /// inner one) by its sum over `group`, in the parameters' order on every rank.
    pub fn sum<B: Backend>(
        &self,
        grads: &mut GradientsParams,
        group: &ProcessGroup,
    ) -> Result<(), GradSumError> {
        for &(id, dims) in &self.params {
            all_reduce_gradient_of_rank::<B>(grads, id, dims, group)?;
        }
        Ok(())
    }
}
