//! Parameters tied across pipeline stages: one parameter that two stages both use (a token
//! embedding on the first stage that the last stage's LM head multiplies by), held as a copy on
//! each. Both copies start equal and receive the same gradient, the sum of the two uses',
//! `∂L/∂W = ∂L/∂W|first + ∂L/∂W|second` (in that order), so they stay equal under any
//! elementwise optimizer.

use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use wildfire_backend::comm::ProcessGroup;

use crate::grad_sum::{GradSumError, all_reduce_gradient};

/// This rank's copies of a tied parameter: the first use's (`first`, e.g. the embedding), the
/// second's (`second`, e.g. the head's copy), each where this rank holds it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TiedCopies {
    pub first: Option<ParamId>,
    pub second: Option<ParamId>,
}

impl TiedCopies {
    /// Gives this rank's copies the sum of both gradients (of rank `D`, on the autodiff
    /// backend's inner backend `B`): added here where this rank holds both copies, all-reduced
    /// over `group` where it holds one (`group` the ranks of the two stages,
    /// [`crate::Mesh::tie_group`], the first stage's first); nothing where it holds neither.
    pub fn sum<B: Backend, const D: usize>(
        &self,
        grads: &mut GradientsParams,
        group: Option<&ProcessGroup>,
    ) -> Result<(), GradSumError> {
        match (self.first, self.second, group) {
            (Some(first), Some(second), _) => {
                let a = grads.remove::<B, D>(first);
                let b = grads.remove::<B, D>(second);
                let (a, b) = match (a, b) {
                    (Some(a), Some(b)) => (a, b),
                    (None, _) => return Err(GradSumError::Missing { id: first }),
                    (_, None) => return Err(GradSumError::Missing { id: second }),
                };
                let sum = a + b;
                grads.register(first, sum.clone());
                grads.register(second, sum);
                Ok(())
            }
            (Some(id), None, Some(group)) | (None, Some(id), Some(group)) => {
                all_reduce_gradient::<B, D>(grads, id, group)
            }
            _ => Ok(()),
        }
    }

    /// Both copies, where this rank holds both.
    pub fn both(&self) -> Option<(ParamId, ParamId)> {
        self.first.zip(self.second)
    }
}
