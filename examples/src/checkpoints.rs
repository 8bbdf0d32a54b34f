//! Checkpoints of the tensor-parallel and pipeline loops, through wildfire's checkpoint library:
//! every rank writes its part of the model and of AdamW's moments as boxes of the whole tensors,
//! named by their paths in the whole model (`blocks.1.module.linear.weight`), and a run resumes
//! from the newest checkpoint in its directory under any tensor-parallel degree or pipeline cut:
//! each rank loads the part its own layout gives it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use burn::module::AutodiffModule;
use burn::optim::AdamW;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::tensor::TensorData;
use burn::tensor::backend::AutodiffBackend;
use wildfire_backend::comm::ProcessGroup;
use wildfire_parallel::checkpoint::Snapshot;
use wildfire_parallel::checkpoint::module::ModuleLayout;
use wildfire_parallel::checkpoint::optimizer::{load_optimizer, optimizer_slices};
use wildfire_parallel::checkpoint::slices::join_slices;
use wildfire_parallel::checkpoint::store;
use wildfire_parallel::pp::graphs_lock;

/// Burn's AdamW of module `M`.
pub type AdamWOf<M, B> = OptimizerAdaptor<AdamW, M, B>;

/// Where a run keeps its checkpoints: one after every `every` steps under `dir` (none when 0);
/// a run whose `dir` holds one resumes from the newest.
#[derive(Debug, Clone)]
pub struct Checkpoints {
    pub dir: PathBuf,
    pub every: usize,
}

/// The newest checkpoint of a run: the steps it had taken and its whole tensors, by name.
#[derive(Debug, Clone)]
pub struct Resumed {
    pub step: usize,
    pub tensors: BTreeMap<String, TensorData>,
}

impl Checkpoints {
    /// The newest committed checkpoint in the directory, if it holds one.
    pub fn latest(&self) -> anyhow::Result<Option<Resumed>> {
        let Some(dir) = store::latest_checkpoint(&self.dir)? else {
            return Ok(None);
        };
        let (manifest, slices) = store::read_checkpoint(&dir)?;
        let tensors = join_slices(slices).with_context(|| format!("{}", dir.display()))?;
        Ok(Some(Resumed {
            step: manifest.step as usize,
            tensors,
        }))
    }
}

/// `module` and its `optimizer` as the newest of `checkpoints` left them (this rank's part under
/// `layout`), with the step to go on from; unchanged from step 0 without a checkpoint.
pub fn resume<B, M>(
    checkpoints: Option<&Checkpoints>,
    layout: &ModuleLayout,
    module: M,
    optimizer: AdamWOf<M, B>,
) -> anyhow::Result<(M, AdamWOf<M, B>, usize)>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let Some(resumed) = checkpoints.map(Checkpoints::latest).transpose()?.flatten() else {
        return Ok((module, optimizer, 0));
    };
    // Loading makes new parameter leaves: thread ranks take the autodiff lock for it.
    let _lock = graphs_lock();
    let module = layout.load(module, &resumed.tensors)?;
    let optimizer = load_optimizer(layout, &module, optimizer, &resumed.tensors)?;
    Ok((module, optimizer, resumed.step))
}

/// After `steps` steps, when one of `checkpoints` is due: writes this rank's part of `module`
/// and `optimizer` (its slices under `layout`). Every rank of `world` calls this.
pub fn save_when_due<B, M>(
    checkpoints: Option<&Checkpoints>,
    steps: usize,
    layout: &ModuleLayout,
    module: &M,
    optimizer: &AdamWOf<M, B>,
    world: &ProcessGroup,
) -> anyhow::Result<()>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let Some(checkpoints) = checkpoints else {
        return Ok(());
    };
    if checkpoints.every == 0 || !steps.is_multiple_of(checkpoints.every) {
        return Ok(());
    }
    let mut slices = layout.slices(module)?;
    slices.extend(optimizer_slices(layout, module, optimizer)?);
    let snapshot = Snapshot {
        step: steps as u64,
        slices,
        state: serde_json::Value::Null,
    };
    snapshot.write(&checkpoints.dir, world)?;
    Ok(())
}
