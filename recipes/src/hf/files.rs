//! Safetensors weights as Hugging Face lays them out: one `model.safetensors`, or shards
//! `model-0000i-of-0000n.safetensors` listed by `model.safetensors.index.json` (its
//! `weight_map` names each tensor's shard).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use burn::tensor::{DType, TensorData};
use safetensors::SafeTensors;

/// The name of a single-file checkpoint in a model directory.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The name of a sharded checkpoint's index in a model directory.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The weights file (or index) a path names: a `.safetensors` file, an index `.json`, or a model
/// directory holding one of [`SINGLE_FILE`] and [`INDEX_FILE`].
pub fn weights_in(path: &Path) -> anyhow::Result<PathBuf> {
    if !path.is_dir() {
        return Ok(path.to_path_buf());
    }
    for name in [INDEX_FILE, SINGLE_FILE] {
        if path.join(name).exists() {
            return Ok(path.join(name));
        }
    }
    bail!(
        "{} holds neither {SINGLE_FILE} nor {INDEX_FILE}",
        path.display()
    )
}

/// Every tensor of the weights at `path` (see [`weights_in`]) by its name in the file, as f32
/// (F16 and BF16 are widened exactly).
pub fn read_tensors(path: &Path) -> anyhow::Result<BTreeMap<String, TensorData>> {
    let path = weights_in(path)?;
    if path.extension().is_some_and(|e| e == "json") {
        let mut tensors = BTreeMap::new();
        for shard in shards(&path)? {
            tensors.append(&mut read_file(&shard)?);
        }
        return Ok(tensors);
    }
    read_file(&path)
}

/// The shard files an index names, each once, in order.
fn shards(index: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index)
        .with_context(|| format!("cannot read {}", index.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", index.display()))?;
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        bail!("{} has no weight_map object", index.display());
    };
    let mut files: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
    files.sort_unstable();
    files.dedup();
    let dir = index.parent().unwrap_or(Path::new(""));
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

fn read_file(path: &Path) -> anyhow::Result<BTreeMap<String, TensorData>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let file = SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{} is not a safetensors file", path.display()))?;
    let mut tensors = BTreeMap::new();
    for (key, view) in file.tensors() {
        let dtype = match view.dtype() {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            other => bail!(
                "{}: tensor {key} has dtype {other:?}; expected F32, F16 or BF16",
                path.display()
            ),
        };
        let data = TensorData::from_bytes_vec(view.data().to_vec(), view.shape().to_vec(), dtype)
            .convert_dtype(DType::F32);
        tensors.insert(key, data);
    }
    Ok(tensors)
}

/// Writes f32 `tensors` (in order) into `dir`: one [`SINGLE_FILE`] when they fit in
/// `max_shard_bytes`, else shards of at most that size (a larger tensor gets a shard of its
/// own) and [`INDEX_FILE`]. Returns the file written, or the index.
pub fn write_tensors(
    dir: &Path,
    tensors: &[(String, TensorData)],
    max_shard_bytes: u64,
) -> anyhow::Result<PathBuf> {
    let mut groups: Vec<Vec<&(String, TensorData)>> = vec![Vec::new()];
    let mut filled = 0u64;
    for tensor in tensors {
        let bytes = tensor.1.as_bytes().len() as u64;
        let started = !groups.last().expect("one group at least").is_empty();
        if started && filled + bytes > max_shard_bytes {
            groups.push(Vec::new());
            filled = 0;
        }
        groups.last_mut().expect("one group at least").push(tensor);
        filled += bytes;
    }
    if groups.len() == 1 {
        let path = dir.join(SINGLE_FILE);
        write_file(&path, &groups[0])?;
        return Ok(path);
    }
    let n = groups.len();
    let mut weight_map = BTreeMap::new();
    for (i, group) in groups.iter().enumerate() {
        let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        write_file(&dir.join(&name), group)?;
        for (tensor, _) in group {
            weight_map.insert(tensor.clone(), name.clone());
        }
    }
    let total: usize = tensors.iter().map(|(_, d)| d.as_bytes().len()).sum();
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    let path = dir.join(INDEX_FILE);
    std::fs::write(&path, serde_json::to_string_pretty(&index)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

fn write_file(path: &Path, tensors: &[&(String, TensorData)]) -> anyhow::Result<()> {
    let views = tensors
        .iter()
        .map(|(name, data)| {
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                data.shape.to_vec(),
                data.as_bytes(),
            )
            .map(|view| (name.clone(), view))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path)
        .with_context(|| format!("cannot write {}", path.display()))
}
