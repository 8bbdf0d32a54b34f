//! ZeRO's state in a checkpoint. Under stages 1–3 a rank owns a contiguous piece of each
//! flattened parameter's moments (and under stage 3 of the parameter): it stores that piece as
//! a slice of the flattened tensor, global shape `[numel]` with its offset, under the names the
//! other layouts use (`<path>`, `optim.exp_avg.<path>`, `optim.exp_avg_sq.<path>`). The
//! flattened shapes and the step counts are the caller's to keep beside the tensors (every
//! rank's, gathered by [`gather_union`]), e.g. in the manifest's state.
//!
//! Under tensor parallelism the flattening of a rank's part is not a box of the whole tensor,
//! so a split parameter's pieces are stored under the part's name, `<path>@tp{r}of{s}`, and
//! loading places every part into the whole tensor by the plan ([`join_tensor_parallel_parts`]).

use std::collections::BTreeMap;

use burn::module::ParamId;
use burn::tensor::TensorData;
use serde::Serialize;
use serde::de::DeserializeOwned;
use wildfire_backend::comm::{CommError, ProcessGroup};

use super::module::ModuleLayout;
use super::optimizer::{EXP_AVG, EXP_AVG_SQ};
use super::slices::{join_slices, part_slices};
use super::store::{CheckpointError, Dtype, TensorSlice, invalid_slice};
use crate::fsdp::{Piece, ZeroError, ZeroOptimizer};
use crate::tp::{TpPlan, TpStyle};

/// Marks the name of one tensor-parallel rank's part of a tensor (see [`flat_name`]).
const TP_PART: &str = "@tp";

/// Why ZeRO's state could not be saved.
#[derive(Debug, thiserror::Error)]
pub enum ZeroCheckpointError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Zero(#[from] ZeroError),
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// This rank's part of ZeRO's state: slices to store, and the manifest's entries (every
/// rank's, once gathered by [`gather_union`]).
#[derive(Debug, Default)]
pub struct ZeroSlices {
    pub slices: Vec<TensorSlice>,
    /// AdamW's step count `t` by parameter path (of the parameters whose moments this rank
    /// holds a piece of).
    pub steps: BTreeMap<String, usize>,
    /// The shape of every flattened tensor by stored name, to restore on load.
    pub flat_shapes: BTreeMap<String, Vec<usize>>,
}

impl ZeroSlices {
    /// The pieces `zero` holds, of the parameters `paths` names by id (`layout`'s paths), that
    /// this tensor-parallel rank stores; a copy of another parameter
    /// ([`ModuleLayout::with_copy`]) is stored as its original, by the original's owner.
    pub fn of<B: burn::tensor::backend::Backend>(
        zero: &ZeroOptimizer<B>,
        paths: &BTreeMap<ParamId, String>,
        layout: &ModuleLayout,
    ) -> Result<Self, ZeroCheckpointError> {
        let mut out = Self::default();
        let original = |id: ParamId| paths.get(&id).filter(|p| !layout.copies.contains_key(*p));
        for piece in zero.pieces()? {
            let Some(path) = original(piece.id) else {
                continue;
            };
            if let Some(stored) = flat_name(layout, path)? {
                out.slices.extend(piece_slices(&stored, &piece));
            }
            if piece.exp_avg.is_some() {
                out.steps.insert(path.clone(), piece.time);
            }
        }
        for slot in zero.layout().buckets.iter().flat_map(|b| &b.slots) {
            let Some(path) = original(slot.param.id) else {
                continue;
            };
            if let Some(stored) = flat_name(layout, path)? {
                out.flat_shapes.insert(stored, slot.param.shape.clone());
            }
        }
        Ok(out)
    }
}

/// The name under which this rank stores the flattened pieces of parameter `path` (and of its
/// moments): the path itself for a parameter it holds whole, `<path>@tp{r}of{s}` for its part
/// of a split one; `None` when another tensor-parallel rank stores them.
fn flat_name(layout: &ModuleLayout, path: &str) -> Result<Option<String>, CheckpointError> {
    let dims = layout.shape(path)?.len();
    let plan = &layout.plan;
    Ok(match (layout.stores(path)?, plan.is_split(path, dims)) {
        (false, _) => None,
        (true, true) => Some(format!("{path}{TP_PART}{}of{}", plan.rank, plan.size)),
        (true, false) => Some(path.to_string()),
    })
}

/// A piece of a flattened parameter (and of its moments) as stored slices.
fn piece_slices(name: &str, piece: &Piece) -> Vec<TensorSlice> {
    let stored = [
        (name.to_string(), &piece.param),
        (format!("{EXP_AVG}{name}"), &piece.exp_avg),
        (format!("{EXP_AVG_SQ}{name}"), &piece.exp_avg_sq),
    ];
    stored
        .into_iter()
        .filter_map(|(name, data)| {
            let values = data.as_ref()?;
            Some(TensorSlice {
                name,
                dtype: Dtype::F32,
                global_shape: vec![piece.param_numel],
                offset: vec![piece.offset],
                shape: vec![piece.numel],
                bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            })
        })
        .collect()
}

/// The union of every rank's `map` (a collective over `world`): the manifest's entries of
/// every rank.
pub fn gather_union<T: Serialize + DeserializeOwned>(
    world: &ProcessGroup,
    map: BTreeMap<String, T>,
) -> Result<BTreeMap<String, T>, CommError> {
    if world.size() == 1 {
        return Ok(map);
    }
    let mut all = BTreeMap::new();
    for part in world.all_gather_json(&map)? {
        all.extend(part);
    }
    Ok(all)
}

/// The parameter path of a stored tensor: a first or second moment's parameter (the names
/// ZeRO's pieces use), or the tensor itself.
pub fn param_of(stored: &str) -> &str {
    stored
        .strip_prefix(EXP_AVG)
        .or_else(|| stored.strip_prefix(EXP_AVG_SQ))
        .unwrap_or(stored)
}

/// `data` in `shape`: itself, or a flattened tensor of as many elements (ZeRO's pieces).
pub fn shaped(data: &TensorData, shape: &[usize]) -> Option<TensorData> {
    if data.shape.as_slice() == shape {
        return Some(data.clone());
    }
    let numel: usize = shape.iter().product();
    (data.shape.as_slice() == [numel])
        .then(|| TensorData::from_bytes_vec(data.as_bytes().to_vec(), shape.to_vec(), data.dtype))
}

/// The parameter path, rank and tensor-parallel size of a part's name (`<path>@tp{r}of{s}`).
fn parse_tp_part(name: &str) -> Option<(&str, usize, usize)> {
    let (base, part) = name.rsplit_once(TP_PART)?;
    let (rank, size) = part.split_once("of")?;
    Some((base, rank.parse().ok()?, size.parse().ok()?))
}

/// `tensors` with their tensor-parallel parts (named `<name>@tp{r}of{s}`, each in its rank's
/// local shape) joined into whole tensors, each part placed as rank `r` of `s` holds it under
/// the plan of `rules`; the whole shapes come from the parameters in `params`.
pub fn join_tensor_parallel_parts(
    tensors: BTreeMap<String, TensorData>,
    params: &BTreeMap<String, TensorData>,
    rules: &[(&str, TpStyle)],
) -> Result<BTreeMap<String, TensorData>, CheckpointError> {
    let mut whole = BTreeMap::new();
    let mut parts = Vec::new();
    for (name, data) in tensors {
        let Some((stored, rank, size)) = parse_tp_part(&name) else {
            whole.insert(name, data);
            continue;
        };
        let param = param_of(stored);
        let Some(global) = params.get(param) else {
            let reason = format!("is a part of {param}, which the checkpoint lacks");
            return Err(invalid_slice(&name, reason));
        };
        let plan = TpPlan::new(rules, rank, size);
        let global = global.shape.to_vec();
        parts.extend(part_slices(
            &plan,
            param,
            &global,
            stored.to_string(),
            data,
        )?);
    }
    whole.extend(join_slices(parts)?);
    Ok(whole)
}
