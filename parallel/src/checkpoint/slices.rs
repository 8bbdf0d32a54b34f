//! Tensors as checkpoint slices and back: a tensor-parallel rank's part of a tensor as the boxes
//! of the whole tensor it holds ([`part_slices`]), and whole tensors joined from the boxes any
//! layout wrote ([`join_slices`]), which must tile each tensor exactly once.

use std::collections::BTreeMap;

use burn::tensor::{DType, TensorData};

use super::store::{CheckpointError, Dtype, TensorSlice, cut_box, invalid_slice, paste_box};
use crate::tp::TpPlan;

/// `data` as a whole-tensor slice named `name`.
pub fn to_slice(name: String, data: TensorData) -> Result<TensorSlice, CheckpointError> {
    let dtype = match data.dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        other => {
            let reason = format!("dtype {other:?}, which checkpoints do not store");
            return Err(invalid_slice(&name, reason));
        }
    };
    let shape = data.shape.to_vec();
    Ok(TensorSlice::whole(
        name,
        dtype,
        shape,
        data.as_bytes().to_vec(),
    ))
}

/// A whole-tensor slice as its name and data.
pub fn to_data(slice: TensorSlice) -> Result<(String, TensorData), CheckpointError> {
    if slice.shape != slice.global_shape {
        let reason = format!(
            "a slice {:?} at {:?} of {:?} where a whole tensor is needed",
            slice.shape, slice.offset, slice.global_shape
        );
        return Err(invalid_slice(&slice.name, reason));
    }
    let dtype = match slice.dtype {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        other => {
            let reason = format!("dtype {other:?}, which no parameter uses");
            return Err(invalid_slice(&slice.name, reason));
        }
    };
    let data = TensorData::from_bytes_vec(slice.bytes, slice.shape, dtype);
    Ok((slice.name, data))
}

/// Rank `plan.rank`'s part `data` of parameter `name` (whole shape `global`) as the slices
/// stored under `stored` (the parameter's name, or one of its moments'): each box of the whole
/// tensor it holds (one, or one per section of a sectioned column split), cut from `data` in
/// order along the split dimension.
pub fn part_slices(
    plan: &TpPlan,
    name: &str,
    global: &[usize],
    stored: String,
    data: TensorData,
) -> Result<Vec<TensorSlice>, CheckpointError> {
    let Some(dim) = plan.split_dim(name, global.len()) else {
        return Ok(vec![to_slice(stored, data)?]);
    };
    let boxes = plan.boxes(name, global);
    let whole = to_slice(stored, data)?;
    let elem = whole.dtype.size();
    let mut local_offset = vec![0; global.len()];
    let mut slices = Vec::with_capacity(boxes.len());
    for part in boxes {
        let bytes = cut_box(&whole.bytes, elem, &whole.shape, &local_offset, &part.shape);
        local_offset[dim] += part.shape[dim];
        slices.push(TensorSlice {
            name: whole.name.clone(),
            dtype: whole.dtype,
            global_shape: global.to_vec(),
            offset: part.offset,
            shape: part.shape,
            bytes,
        });
    }
    if local_offset[dim] != whole.shape[dim] {
        let reason = format!(
            "holds {} entries along dimension {dim}, but the plan gives rank {} {} of the whole \
             {global:?}",
            whole.shape[dim], plan.rank, local_offset[dim]
        );
        return Err(invalid_slice(name, reason));
    }
    Ok(slices)
}

/// The tensors of a checkpoint by name, each joined from its slices: a whole tensor, or boxes of
/// it (tensor-parallel parts, or pieces of a flattened tensor under ZeRO) that must cover it
/// exactly once.
pub fn join_slices(
    slices: Vec<TensorSlice>,
) -> Result<BTreeMap<String, TensorData>, CheckpointError> {
    let mut by_name: BTreeMap<String, Vec<TensorSlice>> = BTreeMap::new();
    for slice in slices {
        by_name.entry(slice.name.clone()).or_default().push(slice);
    }
    let mut tensors = BTreeMap::new();
    for (name, mut boxes) in by_name {
        if boxes.len() == 1 && boxes[0].shape == boxes[0].global_shape {
            let (name, data) = to_data(boxes.remove(0))?;
            tensors.insert(name, data);
            continue;
        }
        let (global, dtype) = (boxes[0].global_shape.clone(), boxes[0].dtype);
        let numel: usize = global.iter().product();
        let elem = dtype.size();
        let mut bytes = vec![0; numel * elem];
        // How many boxes cover each element (one byte per element: a box of this tensor's
        // one-byte "dtype").
        let mut cover = vec![0u8; numel];
        for part in &boxes {
            if part.global_shape != global || part.dtype != dtype {
                let reason = format!(
                    "its slices disagree on the whole tensor ({:?} {:?} and {dtype:?} {global:?})",
                    part.dtype, part.global_shape
                );
                return Err(invalid_slice(&name, reason));
            }
            let (offset, shape) = (&part.offset, &part.shape);
            paste_box(&mut bytes, elem, &global, offset, shape, &part.bytes);
            let seen = cut_box(&cover, 1, &global, offset, shape);
            let once: Vec<u8> = seen.iter().map(|c| c.saturating_add(1)).collect();
            paste_box(&mut cover, 1, &global, offset, shape, &once);
        }
        let covered = cover.iter().filter(|&&c| c == 1).count();
        if covered != numel {
            let twice = cover.iter().filter(|&&c| c > 1).count();
            let reason = format!(
                "its {} slices do not tile its shape {global:?}: {covered} of {numel} elements \
                 are covered once, {twice} more than once",
                boxes.len()
            );
            return Err(invalid_slice(&name, reason));
        }
        let (_, data) = to_data(TensorSlice::whole(name.clone(), dtype, global, bytes))?;
        tensors.insert(name, data);
    }
    Ok(tensors)
}
