//! [`CollectiveBackend`] for `Autodiff<Parallel<B>>`: the forward mapping runs on the inner
//! backend and the backward mapping is recorded as the node's backward step.

use std::any::TypeId;
use std::marker::PhantomData;

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
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

/// The backward step of [`CollectiveBackend::comm_all_gather_recomputed`]: the gradient is
/// reduce-scattered to the gathered tensor; the second parent only orders the node.
#[derive(Debug)]
struct RecomputedGatherBackward {
    group: ProcessGroup,
    dim: usize,
}

impl<B: Backend> Backward<Parallel<B>, 2> for RecomputedGatherBackward {
    type State = ();

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [gathered, _after] = ops.parents;
        let grad = grads.consume::<Parallel<B>>(&ops.node);
        if let Some(node) = gathered {
            let part = Mapping::ReduceScatter(self.dim)
                .apply::<Parallel<B>>(grad, &self.group)
                .unwrap_or_else(|e| panic!("backward of a recomputed all-gather failed: {e}"));
            grads.register::<Parallel<B>>(node.id, part);
        }
    }
}

/// The all-gather of a memory-bound node, run again when the backward pass needs its output.
struct RetroAllGather<B> {
    input: NodeId,
    group: ProcessGroup,
    dim: usize,
    _backend: PhantomData<fn() -> B>,
}

impl<B> std::fmt::Debug for RetroAllGather<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetroAllGather")
            .field("group", &self.group.describe())
            .field("dim", &self.dim)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> RetroForward for RetroAllGather<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let input = states.get_state::<FloatTensor<Parallel<B>>>(&self.input);
        let output = Mapping::AllGather(self.dim)
            .apply::<Parallel<B>>(input, &self.group)
            .unwrap_or_else(|e| panic!("all-gather again in a backward pass failed: {e}"));
        states.save(out_node, output);
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

    fn comm_all_gather_recomputed(
        tensor: FloatTensor<Self>,
        group: &ProcessGroup,
        dim: usize,
        after: &FloatTensor<Self>,
    ) -> Result<FloatTensor<Self>, CommError> {
        let output =
            Mapping::AllGather(dim).apply::<Parallel<B>>(tensor.primitive.clone(), group)?;
        let retro = RetroAllGather::<B> {
            input: tensor.node.id,
            group: group.clone(),
            dim,
            _backend: PhantomData,
        };
        Ok(RecomputedGatherBackward {
            group: group.clone(),
            dim,
        }
        .prepare::<C>([tensor.node.clone(), after.node.clone()])
        .memory_bound()
        .retro_forward(retro)
        .parents([&tensor])
        .stateless(output))
    }

    fn recomputes_gathers() -> bool {
        TypeId::of::<C>() == TypeId::of::<BalancedCheckpointing>()
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
