//! Training checkpoints: the model, AdamW's moments, and the state that makes a resumed run
//! continue bitwise where it stopped (step, schedule position, RNG seed, data cursor, config).
//!
//! Tensors go through [`store`] (one safetensors file per rank, each tensor with its global
//! shape and slice, a manifest with sha256s, atomic commit). Parameters are stored under their
//! global names (`blocks.3.mlp.c_fc.weight`); AdamW's moments under `optim.exp_avg.<name>` and
//! `optim.exp_avg_sq.<name>`, PyTorch's names for them.

mod distributed;
pub mod store;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use burn::module::Param;
use burn::optim::record::AdaptorRecord;
use burn::optim::{AdamWState, AdaptiveMomentumState, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::config::RunConfig;
use crate::data::{Cursor, TokenizerKind};
use wildfire_backend::comm::ProcessGroup;

use crate::model::params::{ParamFn, collect_params, load_params, param_names};
use crate::model::{Gpt, GptChunks, GptConfig, TIED_COPY, TOKEN_EMBEDDING};
use crate::optim::{GptOptimizer, MatrixDecayAdamW};
use store::{Dtype, TensorSlice};

const EXP_AVG: &str = "optim.exp_avg.";
const EXP_AVG_SQ: &str = "optim.exp_avg_sq.";

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
    /// Where the training data stream continues.
    pub cursor: Cursor,
    /// The backend RNG is reseeded from `(seed, step)` before every step, so this seed and
    /// `step` are its whole state.
    pub rng_seed: u64,
    /// Position of the learning-rate schedule (steps it has produced).
    pub schedule_step: u64,
    /// AdamW's step count `t` (bias correction) per parameter that has moments.
    pub optimizer_steps: BTreeMap<String, usize>,
}

fn to_slice(name: String, data: TensorData) -> anyhow::Result<TensorSlice> {
    let dtype = match data.dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        other => bail!("tensor {name} has dtype {other:?}, which checkpoints do not store"),
    };
    Ok(TensorSlice::whole(
        name,
        dtype,
        data.shape.to_vec(),
        data.as_bytes().to_vec(),
    ))
}

fn to_data(slice: TensorSlice) -> anyhow::Result<(String, TensorData)> {
    if slice.shape != slice.global_shape {
        bail!(
            "tensor {} holds a slice {:?} at {:?} of {:?}; this run needs whole tensors",
            slice.name,
            slice.shape,
            slice.offset,
            slice.global_shape
        );
    }
    let dtype = match slice.dtype {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        other => bail!(
            "tensor {} has dtype {other:?}, which no parameter uses",
            slice.name
        ),
    };
    Ok((
        slice.name,
        TensorData::from_bytes_vec(slice.bytes, slice.shape, dtype),
    ))
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

/// AdamW moments of every parameter that has them, as named tensors plus step counts. The tied
/// copy of the token embedding is skipped: its moments equal the embedding's.
struct CollectMoments<'a, B: AutodiffBackend> {
    records: &'a ChunksRecord<B>,
    tensors: Vec<(String, TensorData)>,
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
        self.tensors
            .push((format!("{EXP_AVG}{name}"), momentum.moment_1.into_data()));
        self.tensors
            .push((format!("{EXP_AVG_SQ}{name}"), momentum.moment_2.into_data()));
        self.steps.insert(name.to_string(), momentum.time);
    }
}

/// Writes a committed checkpoint of this rank's `model` chunks, their `optimizer` moments and
/// `state` under `root`: every rank of `world` writes its own shard (the tensors it holds, by
/// global name), and rank 0 commits once all are written. Returns the directory.
pub fn save<B: AutodiffBackend>(
    root: &Path,
    model: &GptChunks<B>,
    optimizer: &ChunksOptimizer<B>,
    mut state: TrainState,
    world: &ProcessGroup,
) -> anyhow::Result<PathBuf> {
    let records = optimizer.to_record();
    let mut moments = CollectMoments::<B> {
        records: &records,
        tensors: Vec::new(),
        steps: BTreeMap::new(),
    };
    model.for_each_param(&mut moments);
    let params = model
        .chunks
        .iter()
        .flat_map(|chunk| collect_params(chunk, chunk.first_block))
        .filter(|(name, _, _)| name != TIED_COPY)
        .map(|(name, _, data)| (name, data));
    let slices = params
        .chain(moments.tensors)
        .map(|(name, data)| to_slice(name, data))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Every rank's moment step counts go into the one manifest.
    state.optimizer_steps = gather_steps(world, moments.steps)?;
    if world.size() == 1 {
        let state = serde_json::to_value(&state)?;
        return Ok(store::write_checkpoint(
            root,
            state_step(&state),
            &[(0, slices)],
            state,
        )?);
    }
    distributed::save(root, world, &slices, serde_json::to_value(&state)?)
}

fn state_step(state: &serde_json::Value) -> u64 {
    state["step"].as_u64().unwrap_or_default()
}

/// The union of every rank's `steps` (AdamW step counts by parameter name).
fn gather_steps(
    world: &ProcessGroup,
    steps: BTreeMap<String, usize>,
) -> anyhow::Result<BTreeMap<String, usize>> {
    if world.size() == 1 {
        return Ok(steps);
    }
    let mut all = BTreeMap::new();
    for part in distributed::all_gather_json(world, &steps)? {
        all.extend(part);
    }
    Ok(all)
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
    for slice in slices {
        let (name, data) = to_data(slice)?;
        if name.starts_with("optim.") {
            moments.insert(name, data);
        } else {
            params.insert(name, data);
        }
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

    /// Every chunk with the checkpoint's parameters (see [`Loaded::apply_params`]).
    pub fn apply_params_to_chunks<B: Backend>(
        &self,
        model: GptChunks<B>,
    ) -> anyhow::Result<GptChunks<B>> {
        let chunks = model
            .chunks
            .into_iter()
            .map(|chunk| self.apply_params(chunk))
            .collect::<anyhow::Result<_>>()?;
        Ok(GptChunks { chunks })
    }

    /// Restores AdamW's moments onto `optimizer`, keyed by the ids of `model`'s parameters.
    pub fn apply_moments<B: AutodiffBackend>(
        &self,
        model: &GptChunks<B>,
        optimizer: &ChunksOptimizer<B>,
    ) -> anyhow::Result<()> {
        struct Restore<'a, B: AutodiffBackend> {
            loaded: &'a Loaded,
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
                    let data = self.loaded.moments.get(&format!("{prefix}{stored}"))?;
                    (data.shape.as_slice() == shape.as_slice())
                        .then(|| Tensor::<B::InnerBackend, D>::from_data(data.clone(), &device))
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
                                 or do not have the parameter's shape {shape:?}"
                            )
                        });
                    }
                }
            }
        }
        let mut restore = Restore::<B> {
            loaded: self,
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
