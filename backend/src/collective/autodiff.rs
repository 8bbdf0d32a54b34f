//! [`CollectiveBackend`] for `Autodiff<Parallel<B>>`: the forward mapping runs on the inner
//! backend and the backward mapping is recorded as the node's backward step.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, unary};
use burn::tensor::backend::Backend;
use burn::tensor::ops::{Device, FloatTensor};

use super::{CollectiveBackend, Mapping};
use crate::Parallel;
use crate::comm::{CommError, ProcessGroup};

/// The backward step of a collective: the gradient goes through `mapping` over `group`.
#[derive(Debug)]
struct CollectiveBackward {
    group: ProcessGroup,
    mapping: Mapping,
}

impl<B: Backend> Backward<Parallel<B>, 1> for CollectiveBackward {
    type State = ();

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let Self { group, mapping } = self;
        unary::<Parallel<B>, _>(ops.parents, ops.node, grads, |grad| {
            mapping
                .apply::<Parallel<B>>(grad, &group)
                .unwrap_or_else(|e| panic!("backward of a collective ({mapping:?}) failed: {e}"))
        });
    }
}

/// A tensor outside the graph: the gradient stops at it.
fn leaf<B: Backend, C: CheckpointStrategy>(
    primitive: FloatTensor<Parallel<B>>,
) -> FloatTensor<Autodiff<Parallel<B>, C>> {
    <FloatTensor<Autodiff<Parallel<B>, C>>>::new(primitive)
}

impl<B: Backend, C: CheckpointStrategy> CollectiveBackend for Autodiff<Parallel<B>, C> {
    fn comm_map(
        tensor: FloatTensor<Self>,
        group: &ProcessGroup,
        forward: Mapping,
        backward: Option<Mapping>,
    ) -> Result<FloatTensor<Self>, CommError> {
        let node = tensor.node.clone();
        let output = forward.apply::<Parallel<B>>(tensor.primitive, group)?;
        Ok(match backward {
            Some(mapping) => CollectiveBackward {
                group: group.clone(),
                mapping,
            }
            .prepare::<C>([node])
            .compute_bound()
            .stateless(output),
            None => leaf::<B, C>(output),
        })
    }

    fn comm_broadcast(
        tensor: FloatTensor<Self>,
        group: &ProcessGroup,
        root: usize,
    ) -> Result<FloatTensor<Self>, CommError> {
        Parallel::<B>::comm_broadcast(tensor.primitive, group, root).map(leaf::<B, C>)
    }

    fn comm_send(
        tensor: FloatTensor<Self>,
        group: &ProcessGroup,
        dst: usize,
        tag: u64,
    ) -> Result<(), CommError> {
        Parallel::<B>::comm_send(tensor.primitive, group, dst, tag)
    }

    fn comm_recv(
        group: &ProcessGroup,
        src: usize,
        tag: u64,
        device: &Device<Self>,
    ) -> Result<FloatTensor<Self>, CommError> {
        Parallel::<B>::comm_recv(group, src, tag, device).map(leaf::<B, C>)
    }
}
