//! Tensor and sequence parallelism (Megatron-LM) for any Burn module, by plan.
//!
//! A Burn module's type is fixed when it is written, so a plan cannot turn Burn's `Linear` into a
//! column-parallel layer by itself: a model uses [`ParallelLinear`] and [`ParallelEmbedding`]
//! where it wants tensor parallelism (built from Burn's layers, and computing exactly what they
//! compute until split). The plan ([`TpPlan`]: parameter path → [`TpStyle`], as data) decides
//! at run time how each one splits, and [`apply_plan`] applies it to the whole model: each
//! split parameter becomes this rank's part, and each layer's [`TensorParallel`] slot learns
//! its style, so its forward and backward issue the collectives the style needs
//! ([`layers`] states the math). A model whose forward enters or leaves the sequence-parallel
//! region, or computes a vocabulary-parallel loss, keeps a [`TensorParallel`] of its own:
//!
//! ```text
//! const PLAN: &[(&str, TpStyle)] = &[
//!     ("blocks.*.norm", TpStyle::SequenceRegion),
//!     ("blocks.*.up", TpStyle::COLUMN),
//!     ("blocks.*.down", TpStyle::Row),
//! ];
//! let plan = TpPlan::new(PLAN, group.rank(), group.size()).with_sequence_parallel(Some(1));
//! let model = apply_plan(model, &plan, &group)?;
//! // after each backward, under sequence parallelism:
//! SequencePartial::of(&model, &plan).sum::<B::InnerBackend>(&mut grads, &group)?;
//! ```
//!
//! With `p` ranks, rank `r` holds part `r` of `split_ranges(n, p)`; a column or row split must
//! divide (per section), a vocabulary split need not (no padding).

pub mod apply;
pub mod grads;
pub mod layers;
pub mod plan;
pub mod slot;
mod walk;

pub use apply::{apply_plan, check_plan};
pub use grads::SequencePartial;
pub use layers::{ParallelEmbedding, ParallelLinear, vocab_parallel_cross_entropy};
pub use plan::{PlanError, TensorBox, TpPlan, TpStyle, vocabulary_share};
pub use slot::{ActivationPart, TensorParallel};
