//! The walk of a module while a plan is surveyed or applied ([`super::apply`]), kept for its
//! duration in a thread-local: slots hold no parameters, so a [`super::TensorParallel`] learns
//! where it stands (its path, its layer's style) from the walk, since a mapper's type is the
//! caller's and Burn gives a module no other way to see it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::Range;

use wildfire_backend::comm::ProcessGroup;

use super::plan::{TpPlan, TpStyle, vocabulary_share};
use crate::paths::PathStack;

/// What holds a [`TensorParallel`](super::TensorParallel): a layer a plan may split, or a model that reads its
/// group and sequence split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layer {
    Linear,
    Embedding,
    Model,
}

impl Layer {
    /// The layer's name in errors.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Self::Linear => "a ParallelLinear",
            Self::Embedding => "a ParallelEmbedding",
            Self::Model => "a model's TensorParallel",
        }
    }
}

/// What a plan filled in.
#[derive(Debug, Clone)]
pub(crate) struct Applied {
    pub(crate) group: ProcessGroup,
    /// The layer's style under the plan (`None`: no rule names it).
    pub(crate) style: Option<TpStyle>,
    /// The rows of the whole table an embedding holds.
    pub(crate) part: Option<Range<usize>>,
    pub(crate) sequence_dim: Option<usize>,
}

/// The walk in progress on this thread.
pub(super) struct Walk {
    pub(super) path: PathStack,
    /// Survey: the slots met, by the path of the module holding them.
    slots: Vec<(String, Layer)>,
    /// Apply: the plan, the group and every parameter's whole shape (from the survey).
    pub(super) apply: Option<(TpPlan, ProcessGroup, HashMap<String, Vec<usize>>)>,
}

thread_local! {
    static WALK: RefCell<Option<Walk>> = const { RefCell::new(None) };
}

/// Ends the walk when dropped, also when a walk unwinds.
pub(super) struct WalkGuard;

impl WalkGuard {
    pub(super) fn start(
        apply: Option<(TpPlan, ProcessGroup, HashMap<String, Vec<usize>>)>,
    ) -> Self {
        WALK.with(|walk| {
            *walk.borrow_mut() = Some(Walk {
                path: PathStack::default(),
                slots: Vec::new(),
                apply,
            })
        });
        Self
    }

    pub(super) fn slots(&self) -> Vec<(String, Layer)> {
        with_walk(|walk| std::mem::take(&mut walk.slots)).unwrap_or_default()
    }
}

impl Drop for WalkGuard {
    fn drop(&mut self) {
        WALK.with(|walk| walk.borrow_mut().take());
    }
}

pub(super) fn with_walk<T>(f: impl FnOnce(&mut Walk) -> T) -> Option<T> {
    WALK.with(|walk| walk.borrow_mut().as_mut().map(f))
}

/// A slot met by the survey: recorded with the path of the module holding it.
pub(super) fn survey_slot(layer: Layer) {
    with_walk(|walk| {
        if walk.apply.is_none() {
            walk.slots.push((walk.path.parent(), layer));
        }
    });
}

/// What a slot met while a plan is applied learns: its layer's style under the plan, and its
/// part of the vocabulary where it is split by it.
pub(super) fn fill_slot() -> Option<Applied> {
    let applied = with_walk(|walk| {
        let (plan, group, shapes) = walk.apply.as_ref()?;
        let path = walk.path.parent();
        let style = plan.exact_style(&path);
        let part = style
            .zip(shapes.get(&format!("{path}.weight")))
            .and_then(|(style, dims)| vocabulary_part(style, dims, plan.rank, plan.size));
        Some(Applied {
            group: group.clone(),
            style,
            part,
            sequence_dim: plan.sequence_dim,
        })
    });
    applied.flatten()
}

/// Rank `rank`'s part of the vocabulary of a whole weight of shape `dims` that `style` splits
/// by vocabulary over `size` ranks: its rows for an embedding table (`[V, d]`), its columns for
/// a head (`[d, V]`); `None` for any other style.
pub(crate) fn vocabulary_part(
    style: TpStyle,
    dims: &[usize],
    rank: usize,
    size: usize,
) -> Option<Range<usize>> {
    let vocab = match style {
        TpStyle::VocabRows => dims[0],
        TpStyle::VocabColumns => dims[1],
        _ => return None,
    };
    Some(vocabulary_share(vocab, rank, size))
}
