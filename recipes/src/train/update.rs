//! The GPT's side of the data-parallel update (the update itself is
//! `wildfire_parallel::update`, the optimizer type `crate::optim::Optimizers`): its ZeRO
//! layout (a unit per block, the tied embedding alone in its bucket), and the parameters another
//! rank counts in the norm.

use burn::module::ParamId;
use burn::tensor::backend::AutodiffBackend;
use wildfire_parallel::checkpoint::module::ModuleLayout;
use wildfire_parallel::dp::FlatLayout;
use wildfire_parallel::fsdp::ZeroStage;
use wildfire_parallel::pp::TiedCopies;

use crate::model::{GptChunks, TIED_COPY};

/// The ZeRO layout of `model`'s parameters: one unit per chunk under stage 3 (each chunk is one
/// block there), the tied embedding alone in its bucket. Under stage 3 the head's copy of the
/// embedding is left out (it is gathered from the embedding, see `run_sharded_step`); a
/// pipeline's last stage keeps its copy, alone in its bucket too.
pub fn zero_layout<B: AutodiffBackend>(
    model: &GptChunks<B>,
    stage: ZeroStage,
    bucket_bytes: usize,
) -> FlatLayout {
    let TiedCopies { first, second } = model.tied_embedding();
    let by_unit = stage == ZeroStage::ShardParameters;
    let alone: Vec<_> = [first, second].into_iter().flatten().collect();
    let left_out: Vec<_> = second.filter(|_| by_unit).into_iter().collect();
    FlatLayout::of_units(&model.chunks, by_unit, &alone, &left_out, bucket_bytes)
}

/// The parameters of `model` whose gradients another rank of its replica puts into the norm:
/// the head's copy of the tied embedding (the embedding's is counted), and the parameters (or
/// parts) other tensor-parallel ranks hold too, on every one of those ranks but the first.
pub fn counted_elsewhere<B: AutodiffBackend>(
    model: &GptChunks<B>,
    layout: &ModuleLayout,
) -> Vec<ParamId> {
    let plan = &layout.plan;
    model
        .param_ids_where(|name, dims| name == TIED_COPY || !plan.holds_first_copy(name, dims))
        .into_iter()
        .map(|(id, _)| id)
        .collect()
}
