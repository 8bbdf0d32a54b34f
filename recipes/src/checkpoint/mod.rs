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
//! `wildfire_parallel::checkpoint::zero`). Under tensor parallelism a rank writes the boxes of
//! the global tensors it holds (a fused QKV part is 3 boxes) and, of a tensor every
//! tensor-parallel rank holds whole, only the first rank writes it. The head's copy of a tied
//! embedding is stored as the embedding. AdamW's step counts go into the manifest's state.
//! Loading joins the pieces and boxes of every file (and places the parts into the whole
//! tensors), so a checkpoint resumes under any ZeRO stage, pipeline layout and tensor-parallel
//! degree; the library gives each rank its part of the moments
//! (`wildfire_parallel::checkpoint::optimizer`).

pub use wildfire_parallel::checkpoint::crash::{CRASH_ENV, CrashPoint, crash_point};
pub use wildfire_parallel::checkpoint::distributed::Snapshot;
pub use wildfire_parallel::checkpoint::store;
pub use wildfire_parallel::checkpoint::{BackgroundWriter, prune};

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use burn::module::{Param, ParamId};
use burn::optim::{AdamWState, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use serde::{Deserialize, Serialize};
use wildfire_backend::comm::ProcessGroup;
pub use wildfire_parallel::checkpoint::module::ModuleLayout;
use wildfire_parallel::checkpoint::optimizer::{
    EXP_AVG, EXP_AVG_SQ, STEP, flat_moments, optimizer_records,
};
use wildfire_parallel::checkpoint::slices::join_slices;
use wildfire_parallel::checkpoint::zero::{
    ZeroSlices, gather_union, join_tensor_parallel_parts, param_of, shaped,
};
use wildfire_parallel::fsdp::{FullMoments, ZeroStage};
use wildfire_parallel::precision::DynamicLossScaler;

use crate::config::RunConfig;
use crate::data::{Cursor, TokenizerKind};
use crate::model::params::{ParamFn, collect_params, global_paths};
use crate::model::{Gpt, GptChunks, GptConfig, TIED_COPY, tp_rules};
use crate::optim::{GptOptimizer, MatrixDecayAdamW, Optimizers};

/// The non-tensor part of a checkpoint (the manifest's `state`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainState {
    /// Optimizer steps completed.
    pub step: u64,
    pub config: RunConfig,
    pub model: GptConfig,
    pub tokenizer: TokenizerKind,
    /// What rebuilds the tokenizer ([`crate::data::Tokenizer::stored`]): the character
    /// vocabulary, nothing for GPT-2 BPE, or a Hugging Face `tokenizer.json`'s text.
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
            .flat_map(|chunk| collect_params(chunk, chunk.first_block));
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
            let part = ZeroSlices::of(&zero, &names_by_id(model), layout)?;
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

/// The global name of every parameter, by id.
fn names_by_id<B: Backend>(model: &GptChunks<B>) -> BTreeMap<ParamId, String> {
    struct Names(BTreeMap<ParamId, String>);
    impl<B: Backend> ParamFn<B> for Names {
        fn visit<const D: usize>(&mut self, name: &str, param: &Param<Tensor<B, D>>) {
            self.0.insert(param.id, name.to_string());
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
    let rules = tp_rules(&state.model);
    let mut moments = join_tensor_parallel_parts(moments, &params, &rules)?;
    // The manifest keeps AdamW's step counts; the library reads them as tensors.
    for (name, &time) in &state.optimizer_steps {
        let time = TensorData::new(vec![time as i64], [1]);
        moments.insert(format!("{STEP}{name}"), time);
    }
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
    /// The whole `model` with the checkpoint's parameters (ids kept): a checkpoint of any
    /// pipeline layout and tensor-parallel degree loads into the whole model.
    pub fn apply_params<B: Backend>(&self, model: Gpt<B>) -> anyhow::Result<Gpt<B>> {
        let source = || format!("checkpoint {}", self.dir.display());
        ModuleLayout::load_whole(model, &self.params).with_context(source)
    }

    /// The moments of every parameter of `model` that has them, flat, by id (to restore a
    /// sharded optimizer from): this rank's parts of them under `layout`.
    pub fn moments_by_id<B: AutodiffBackend>(
        &self,
        model: &GptChunks<B>,
        layout: &ModuleLayout,
    ) -> anyhow::Result<HashMap<ParamId, FullMoments<B::InnerBackend>>> {
        let mut found = HashMap::new();
        for (chunk, layout) in model.chunks.iter().zip(chunk_layouts(model, layout)) {
            found.extend(flat_moments(&layout, chunk, &self.moments)?);
        }
        Ok(found)
    }

    /// `optimizer` with AdamW's moments restored, keyed by the ids of `model`'s parameters
    /// (this rank's parts of them under `layout`).
    pub fn apply_moments<B: AutodiffBackend>(
        &self,
        model: &GptChunks<B>,
        optimizer: ChunksOptimizer<B>,
        layout: &ModuleLayout,
    ) -> anyhow::Result<ChunksOptimizer<B>> {
        let mut records = Vec::new();
        for (chunk, layout) in model.chunks.iter().zip(chunk_layouts(model, layout)) {
            let found = optimizer_records::<B, _, MatrixDecayAdamW>(&layout, chunk, &self.moments);
            records.extend(found?);
        }
        Ok(optimizer.load_record(records.into_iter().collect()))
    }
}

/// The layout of each chunk of `model`: its blocks named by their global numbers.
fn chunk_layouts<B: Backend>(model: &GptChunks<B>, layout: &ModuleLayout) -> Vec<ModuleLayout> {
    (model.chunks.iter())
        .map(|chunk| layout.clone().at(global_paths(chunk.first_block)))
        .collect()
}
