//! Training checkpoints: the model, AdamW's moments, and the state that makes a resumed run
//! continue bitwise where it stopped (step, schedule position, RNG seed, data cursor, config).
//!
//! Tensors go through [`store`] (one safetensors file per rank, each tensor with its global
//! shape and slice, a manifest with sha256s, atomic commit). Parameters are stored under their
//! global names (`blocks.3.mlp.c_fc.weight`); AdamW's moments under `optim.exp_avg.<name>` and
//! `optim.exp_avg_sq.<name>`, PyTorch's names for them.
//!
//! **Who writes what.** Each rank writes only what it holds, once: a pipeline rank its stages;
//! of data-parallel replicas only the first writes what they all hold (parameters, and moments
//! under ZeRO 0); under ZeRO 1–3 every rank writes its owned parts of the moments (and under
//! ZeRO 3 of the parameters) as pieces of the flattened tensor (see
//! `wildfire_parallel::checkpoint::zero`). Under tensor parallelism a rank writes the boxes of the global tensors it
//! holds (a fused QKV part is 3 boxes) and, of a tensor every tensor-parallel rank holds whole,
//! only the first rank writes it. Loading joins the pieces and
//! boxes of every file (and places the parts into the whole tensors), so a checkpoint resumes
//! under any ZeRO stage, pipeline layout and tensor-parallel degree.

pub use wildfire_parallel::checkpoint::crash::{CRASH_ENV, CrashPoint, crash_point};
pub use wildfire_parallel::checkpoint::distributed::Snapshot;
pub use wildfire_parallel::checkpoint::store;
pub use wildfire_parallel::checkpoint::{BackgroundWriter, prune};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use burn::module::Param;
use burn::optim::record::AdaptorRecord;
use burn::optim::{AdamWState, AdaptiveMomentumState, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use serde::{Deserialize, Serialize};
use wildfire_parallel::precision::DynamicLossScaler;

use crate::config::RunConfig;
use crate::data::{Cursor, TokenizerKind};
use wildfire_backend::comm::ProcessGroup;

use crate::model::params::{ParamFn, collect_params, load_params, param_names};
use crate::model::{Gpt, GptChunks, GptConfig, TIED_COPY, TOKEN_EMBEDDING, TP_PLAN};
use crate::optim::{GptOptimizer, MatrixDecayAdamW, Optimizers};
use burn::module::ParamId;
pub use wildfire_parallel::checkpoint::module::ModuleLayout;
use wildfire_parallel::checkpoint::optimizer::{EXP_AVG, EXP_AVG_SQ};
use wildfire_parallel::checkpoint::slices::join_slices;
use wildfire_parallel::checkpoint::zero::{
    ZeroSlices, gather_union, join_tensor_parallel_parts, param_of, shaped,
};
use wildfire_parallel::fsdp::{FullMoments, ZeroStage};
use wildfire_parallel::tp::TpPlan;

/// The non-tensor part of a checkpoint (the manifest's `state`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainState {
    /// Optimizer steps completed.
    pub step: u64,
    pub config: RunConfig,
    pub model: GptConfig,
    pub tokenizer: TokenizerKind,
    /// The character vocabulary (empty for GPT-2 BPE).
    pub vocab: String,
    /// The manifest hash of the prepared data the run trains on (none for a text corpus).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_hash: Option<String>,
    /// Where the training data stream continues.
    pub cursor: Cursor,
    /// The backend RNG is reseeded from `(seed, step)` before every step, so this seed and
    /// `step` are its whole state.
    pub rng_seed: u64,
    /// Position of the learning-rate schedule (steps it has produced).
    pub schedule_step: u64,
    /// AdamW's step count `t` (bias correction) per parameter that has moments.
    pub optimizer_steps: BTreeMap<String, usize>,
    /// The shapes of parameters stored flattened in pieces (ZeRO 3), to restore on load.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub flat_shapes: BTreeMap<String, Vec<usize>>,
    /// fp16's loss scaler after `step` steps (fp16 runs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scaler: Option<DynamicLossScaler>,
}

/// The name a parameter is stored under: the head's tied copy of the token embedding is the
/// embedding (see `Head::wte`); every other parameter is itself.
fn stored_name(name: &str) -> &str {
    if name == TIED_COPY {
        TOKEN_EMBEDDING
    } else {
        name
    }
}

type ChunksOptimizer<B> = GptOptimizer<GptChunks<B>, B>;
type ChunksRecord<B> = <ChunksOptimizer<B> as Optimizer<GptChunks<B>, B>>::Record;

/// AdamW moments of every parameter that has them, as `(parameter, stored name, tensor)` plus
/// step counts. The tied copy of the token embedding is skipped: its moments equal the
/// embedding's.
struct CollectMoments<'a, B: AutodiffBackend> {
    records: &'a ChunksRecord<B>,
    tensors: Vec<(String, String, TensorData)>,
    steps: BTreeMap<String, usize>,
}

impl<B: AutodiffBackend> ParamFn<B> for CollectMoments<'_, B> {
    fn visit<const D: usize>(&mut self, name: &str, param: &Param<Tensor<B, D>>) {
        let Some(record) = self.records.get(&param.id) else {
            return;
        };
        if name == TIED_COPY {
            return;
        }
        let state: AdamWState<B::InnerBackend, D> = record.clone().into_state();
        let momentum = state.momentum;
        for (prefix, moment) in [
            (EXP_AVG, momentum.moment_1),
            (EXP_AVG_SQ, momentum.moment_2),
        ] {
            let stored = format!("{prefix}{name}");
            self.tensors
                .push((name.to_string(), stored, moment.into_data()));
        }
        self.steps.insert(name.to_string(), momentum.time);
    }
}

/// Writes a committed checkpoint of this rank's `model` chunks, their optimizer state and
/// `state` under `root` ([`snapshot`], then [`Snapshot::write`]). Returns the directory.
pub fn save<B: AutodiffBackend>(
    root: &Path,
    model: &GptChunks<B>,
    optimizers: &Optimizers<B>,
    state: TrainState,
    world: &ProcessGroup,
    data_rank: usize,
    layout: &ModuleLayout,
) -> anyhow::Result<PathBuf> {
    Ok(snapshot(model, optimizers, state, world, data_rank, layout)?.write(root, world)?)
}

/// This rank's part of a checkpoint of its `model` chunks, their optimizer state and `state`,
/// in host memory: what it holds (see the module doc; `data_rank` is its rank among
/// data-parallel replicas, `layout` places its tensor-parallel parts). Every rank of `world`
/// calls this (it gathers the step counts and shapes of every rank for the manifest).
pub fn snapshot<B: AutodiffBackend>(
    model: &GptChunks<B>,
    optimizers: &Optimizers<B>,
    mut state: TrainState,
    world: &ProcessGroup,
    data_rank: usize,
    layout: &ModuleLayout,
) -> anyhow::Result<Snapshot> {
    let first_replica = data_rank == 0;
    let mut slices = Vec::new();
    let mut steps = BTreeMap::new();
    let mut shapes = BTreeMap::new();
    if first_replica && optimizers.stage() != ZeroStage::ShardParameters {
        let params = model
            .chunks
            .iter()
            .flat_map(|chunk| collect_params(chunk, chunk.first_block))
            .filter(|(name, _, _)| name != TIED_COPY);
        for (name, _, data) in params {
            if layout.stores(&name)? {
                slices.extend(layout.param_slices(&name, name.clone(), data)?);
            }
        }
    }
    match optimizers {
        Optimizers::Replicated { optimizer, .. } if first_replica => {
            let records = wildfire_parallel::update::lock(optimizer).to_record();
            let mut moments = CollectMoments::<B> {
                records: &records,
                tensors: Vec::new(),
                steps: BTreeMap::new(),
            };
            model.for_each_param(&mut moments);
            for (name, stored, data) in moments.tensors {
                if layout.stores(&name)? {
                    slices.extend(layout.param_slices(&name, stored, data)?);
                }
            }
            steps = moments.steps;
        }
        Optimizers::Replicated { .. } => {}
        Optimizers::Sharded(_) => {
            let zero = optimizers.zero().context("a sharded optimizer")?;
            let part = ZeroSlices::of(&zero, &stored_paths(model), layout)?;
            slices.extend(part.slices);
            (steps, shapes) = (part.steps, part.flat_shapes);
        }
    }
    // Every rank's step counts and flattened shapes go into the one manifest.
    state.optimizer_steps = gather_union(world, steps)?;
    state.flat_shapes = gather_union(world, shapes)?;
    Ok(Snapshot {
        step: state.step,
        slices,
        state: serde_json::to_value(&state)?,
    })
}

/// The global name of every parameter stored under its own name, by id (the tied copy of the
/// token embedding is stored as the embedding).
fn stored_paths<B: Backend>(model: &GptChunks<B>) -> BTreeMap<ParamId, String> {
    struct Names(BTreeMap<ParamId, String>);
    impl<B: Backend> ParamFn<B> for Names {
        fn visit<const D: usize>(&mut self, name: &str, param: &Param<Tensor<B, D>>) {
            if name != TIED_COPY {
                self.0.insert(param.id, name.to_string());
            }
        }
    }
    let mut names = Names(BTreeMap::new());
    model.for_each_param(&mut names);
    names.0
}

/// A checkpoint read back: its state, parameters and optimizer moments by name.
#[derive(Debug)]
pub struct Loaded {
    pub dir: PathBuf,
    pub state: TrainState,
    pub params: BTreeMap<String, TensorData>,
    pub moments: BTreeMap<String, TensorData>,
}

/// Reads and verifies (sha256 of every file) the checkpoint in `dir`.
pub fn load(dir: &Path) -> anyhow::Result<Loaded> {
    let (manifest, slices) = store::read_checkpoint(dir)?;
    let state: TrainState = serde_json::from_value(manifest.state)
        .with_context(|| format!("checkpoint {} has an unreadable state", dir.display()))?;
    let (mut params, mut moments) = (BTreeMap::new(), BTreeMap::new());
    for (name, data) in join_slices(slices)? {
        let data = match state.flat_shapes.get(param_of(&name)) {
            Some(shape) => shaped(&data, shape).with_context(|| {
                format!("tensor {name} has shape {:?}, not {shape:?}", data.shape)
            })?,
            None => data,
        };
        if name.starts_with("optim.") {
            moments.insert(name, data);
        } else {
            params.insert(name, data);
        }
    }
    let moments = join_tensor_parallel_parts(moments, &params, TP_PLAN)?;
    Ok(Loaded {
        dir: dir.to_path_buf(),
        state,
        params,
        moments,
    })
}

/// The checkpoint `path` names: a checkpoint directory itself, or the newest committed one in
/// `path/checkpoints` (a run directory) or in `path`.
pub fn resolve(path: &Path) -> anyhow::Result<PathBuf> {
    if path.join(store::MANIFEST_FILE).exists() {
        return Ok(path.to_path_buf());
    }
    for root in [path.join("checkpoints"), path.to_path_buf()] {
        if let Some(dir) = store::latest_checkpoint(&root)? {
            return Ok(dir);
        }
    }
    bail!(
        "no complete checkpoint in {} (nor in its checkpoints/ directory)",
        path.display()
    )
}

impl Loaded {
    /// `model` (a whole model or one stage of one) with the checkpoint's parameters (ids
    /// kept). Only the names the model holds are taken, so a checkpoint of any pipeline
    /// layout loads into any other; the tied copy of the token embedding is the embedding.
    pub fn apply_params<B: Backend>(&self, model: Gpt<B>) -> anyhow::Result<Gpt<B>> {
        let source = format!("checkpoint {}", self.dir.display());
        let first = model.first_block;
        let mut needed = BTreeMap::new();
        for name in param_names(&model, first) {
            let stored = stored_name(&name);
            if let Some(data) = self.params.get(stored) {
                needed.insert(name, data.clone());
            }
        }
        Ok(load_params(model, first, needed, &source)?)
    }

    /// The moment `prefix` (`EXP_AVG` or `EXP_AVG_SQ`) of the parameter stored as `stored`, as
    /// this rank holds it: its part under `plan` (see [`TpPlan::local_part`]) of the whole
    /// moment (a flattened one is first reshaped), which must come out in the parameter's
    /// `shape`.
    fn moment<B: Backend, const D: usize>(
        &self,
        prefix: &str,
        stored: &str,
        shape: [usize; D],
        plan: &TpPlan,
        device: &B::Device,
    ) -> Option<Tensor<B, D>> {
        let data = self.moments.get(&format!("{prefix}{stored}"))?;
        let global = self
            .params
            .get(stored)
            .map_or(shape.to_vec(), |p| p.shape.to_vec());
        let whole = Tensor::<B, D>::from_data(shaped(data, &global)?, device);
        let part = plan.local_part(stored, whole);
        (part.dims() == shape).then_some(part)
    }

    /// The moments of every parameter of `model` that has them, flat, by id (to restore a
    /// sharded optimizer from). The tied copy's are the embedding's.
    pub fn moments_by_id<B: AutodiffBackend>(
        &self,
        model: &GptChunks<B>,
        plan: &TpPlan,
    ) -> anyhow::Result<std::collections::HashMap<ParamId, FullMoments<B::InnerBackend>>> {
        struct Gather<'a, B: AutodiffBackend> {
            loaded: &'a Loaded,
            plan: &'a TpPlan,
            found: std::collections::HashMap<ParamId, FullMoments<B::InnerBackend>>,
            error: Option<anyhow::Error>,
        }
        impl<B: AutodiffBackend> ParamFn<B> for Gather<'_, B> {
            fn visit<const D: usize>(&mut self, name: &str, param: &Param<Tensor<B, D>>) {
                let stored = stored_name(name);
                let Some(&time) = self.loaded.state.optimizer_steps.get(stored) else {
                    return;
                };
                let value = param.val().inner();
                let (device, shape) = (value.device(), value.dims());
                let numel = value.shape().num_elements();
                let take = |prefix: &str| {
                    let moment = self
                        .loaded
                        .moment::<B::InnerBackend, D>(prefix, stored, shape, self.plan, &device);
                    moment.map(|m| m.reshape([numel]))
                };
                match (take(EXP_AVG), take(EXP_AVG_SQ)) {
                    (Some(exp_avg), Some(exp_avg_sq)) => {
                        self.found.insert(
                            param.id,
                            FullMoments {
                                exp_avg,
                                exp_avg_sq,
                                time,
                            },
                        );
                    }
                    _ => {
                        self.error.get_or_insert_with(|| {
                            anyhow::anyhow!(
                                "optimizer moments of {stored} are missing from the checkpoint, \
                                 or this rank's part of them does not have the parameter's \
                                 shape {shape:?}"
                            )
                        });
                    }
                }
            }
        }
        let mut gather = Gather::<B> {
            loaded: self,
            plan,
            found: Default::default(),
            error: None,
        };
        model.for_each_param(&mut gather);
        match gather.error {
            Some(error) => Err(error),
            None => Ok(gather.found),
        }
    }

    /// Restores AdamW's moments onto `optimizer`, keyed by the ids of `model`'s parameters
    /// (this rank's parts of them under `plan`).
    pub fn apply_moments<B: AutodiffBackend>(
        &self,
        model: &GptChunks<B>,
        optimizer: &ChunksOptimizer<B>,
        plan: &TpPlan,
    ) -> anyhow::Result<()> {
        struct Restore<'a, B: AutodiffBackend> {
            loaded: &'a Loaded,
            plan: &'a TpPlan,
            records: ChunksRecord<B>,
            error: Option<anyhow::Error>,
        }
        impl<B: AutodiffBackend> ParamFn<B> for Restore<'_, B> {
            fn visit<const D: usize>(&mut self, name: &str, param: &Param<Tensor<B, D>>) {
                let stored = stored_name(name);
                let Some(&time) = self.loaded.state.optimizer_steps.get(stored) else {
                    return;
                };
                let value = param.val().inner();
                let (device, shape) = (value.device(), value.dims());
                let take = |prefix: &str| {
                    self.loaded
                        .moment(prefix, stored, shape, self.plan, &device)
                };
                match (take(EXP_AVG), take(EXP_AVG_SQ)) {
                    (Some(m1), Some(m2)) => {
                        let state = AdamWState::new(AdaptiveMomentumState::new(time, m1, m2));
                        self.records.insert(
                            param.id,
                            AdaptorRecord::<MatrixDecayAdamW, B>::from_state(state),
                        );
                    }
                    _ => {
                        self.error.get_or_insert_with(|| {
                            anyhow::anyhow!(
                                "optimizer moments of {stored} are missing from the checkpoint, \
                                 or this rank's part of them does not have the parameter's \
                                 shape {shape:?}"
                            )
                        });
                    }
                }
            }
        }
        let mut restore = Restore::<B> {
            loaded: self,
            plan,
            records: Default::default(),
            error: None,
        };
        model.for_each_param(&mut restore);
        if let Some(error) = restore.error {
            return Err(error);
        }
        let records = restore.records;
        optimizer.clone().load_record(records);
        Ok(())
    }
}
