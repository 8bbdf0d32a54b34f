//! Sampling text from a checkpoint: temperature, top-k, and a seed that makes it repeatable.
//! Each new token runs the model on that token alone, against a key/value cache of the earlier
//! positions ([`KvCache`]), until the text outgrows the model's context; from there each token
//! runs the model on the latest `context` tokens, as generation without the cache does.

use std::path::Path;
use wildfire_backend::DecoratedBackend;
use wildfire_backend::host_data::aligned;

use anyhow::{Context, bail};
use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::data::{SplitMix64, Tokenizer};
use crate::model::{Gpt, GptConfig, KvCache, StageSpec};
use crate::{checkpoint, hf};

/// How to sample.
#[derive(Debug, Clone)]
pub struct Sampling {
    pub max_new_tokens: usize,
    /// Logits are divided by this; 0 picks the most likely token (greedy).
    pub temperature: f64,
    /// Keep only the `k` most likely tokens; `None` keeps all.
    pub top_k: Option<usize>,
    pub seed: u64,
    /// Reuse earlier positions' keys and values (the same tokens, one position's work a step).
    pub kv_cache: bool,
}

/// The model and tokenizer of the checkpoint `path` names (see [`checkpoint::resolve`]).
pub fn load_model<B: Backend>(
    path: &Path,
    device: &B::Device,
) -> anyhow::Result<(Gpt<B>, Tokenizer, GptConfig)> {
    let loaded = checkpoint::load(&checkpoint::resolve(path)?)?;
    let config = loaded.state.model.clone();
    let model = Gpt::<B>::new(&config, StageSpec::whole(&config), device);
    let model = loaded.apply_params(model)?;
    let tokenizer = Tokenizer::stored(loaded.state.tokenizer, &loaded.state.vocab)?;
    Ok((model, tokenizer, config))
}

/// The model and tokenizer of the Hugging Face model directory `source` names (`hf:DIR`):
/// sizes from its `config.json`, tokenizer as [`hf::tokenizer`] finds it.
pub fn load_hugging_face<B: Backend>(
    source: &str,
    device: &B::Device,
) -> anyhow::Result<(Gpt<B>, Tokenizer, GptConfig)> {
    let config = hf::model_config(source, 0.0)?.with_context(|| {
        format!(
            "--init-from {source}: generation reads the sizes from a model directory's \
             config.json; name the directory"
        )
    })?;
    let tokenizer = hf::tokenizer(hf::source_path(source)?, &config)?;
    if tokenizer.vocab_size() > config.vocab_size {
        bail!(
            "{source}: the tokenizer has {} tokens, the model only {}",
            tokenizer.vocab_size(),
            config.vocab_size
        );
    }
    let model = Gpt::<B>::new(&config, StageSpec::whole(&config), device);
    Ok((hf::init_from(model, &config, source)?, tokenizer, config))
}

/// Continues `prompt` by `sampling.max_new_tokens` tokens; returns prompt + continuation.
pub fn generate<B: DecoratedBackend>(
    model: &Gpt<B>,
    tokenizer: &Tokenizer,
    prompt: &str,
    sampling: &Sampling,
    context: usize,
) -> anyhow::Result<String> {
    if !(sampling.temperature >= 0.0 && sampling.temperature.is_finite()) {
        bail!(
            "--temperature {} must be a finite number ≥ 0",
            sampling.temperature
        );
    }
    if sampling.top_k == Some(0) {
        bail!("--top-k 0 leaves no token to sample");
    }
    let tokens = tokenizer.encode(prompt)?;
    if tokens.is_empty() {
        bail!("the prompt is empty; give at least one token of text");
    }
    let tokens = continue_tokens(model, tokens, sampling, context, tokenizer.vocab_size())?;
    Ok(tokenizer.decode(&tokens)?)
}

/// `tokens` and `sampling.max_new_tokens` more, never sampling an id from `known` on (a padded
/// vocabulary's ids the tokenizer cannot decode).
pub fn continue_tokens<B: DecoratedBackend>(
    model: &Gpt<B>,
    mut tokens: Vec<u32>,
    sampling: &Sampling,
    context: usize,
    known: usize,
) -> anyhow::Result<Vec<u32>> {
    let device = model.devices().into_iter().next().unwrap_or_default();
    let input = |ids: &[u32]| {
        let ids: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        Tensor::<B, 2, Int>::from_data(TensorData::new(ids.clone(), [1, ids.len()]), &device)
    };
    let mut rng = SplitMix64::new(sampling.seed);
    let mut cache = KvCache::new(model);
    for _ in 0..sampling.max_new_tokens {
        let logits = match sampling.kv_cache && tokens.len() <= context {
            true => model.forward_cached(input(&tokens[cache.len()..]), &mut cache),
            false => model.forward(input(&tokens[tokens.len().saturating_sub(context)..])),
        };
        let [_, seq, vocab] = logits.dims();
        let last = aligned(logits.slice([0..1, seq - 1..seq, 0..vocab]).into_data());
        let logits: Vec<f32> = last
            .convert::<f32>()
            .to_vec()
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        tokens.push(pick(&logits[..known.min(logits.len())], sampling, &mut rng) as u32);
    }
    Ok(tokens)
}

/// One token from `logits`: greedy at temperature 0, else from softmax(logits / T) restricted
/// to the top k.
fn pick(logits: &[f32], sampling: &Sampling, rng: &mut SplitMix64) -> usize {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if sampling.temperature == 0.0 {
        return order[0];
    }
    order.truncate(sampling.top_k.unwrap_or(order.len()).min(order.len()));
    let top = logits[order[0]] as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - top) / sampling.temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut target = rng.unit() * total;
    for (&index, weight) in order.iter().zip(&weights) {
        if target < *weight {
            return index;
        }
        target -= weight;
    }
    order[order.len() - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_max_and_top_1_equals_greedy() {
        let logits = [0.1, 2.0, -1.0, 1.9];
        let mut rng = SplitMix64::new(0);
        let greedy = Sampling {
            max_new_tokens: 1,
            temperature: 0.0,
            top_k: None,
            seed: 0,
            kv_cache: true,
        };
        assert_eq!(pick(&logits, &greedy, &mut rng), 1);
        let top1 = Sampling {
            temperature: 1.0,
            top_k: Some(1),
            ..greedy
        };
        for _ in 0..20 {
            assert_eq!(pick(&logits, &top1, &mut rng), 1);
        }
    }

    #[test]
    fn top_k_never_picks_outside_the_k_best() {
        let logits = [5.0, 4.9, -3.0, 4.8, 0.0];
        let mut rng = SplitMix64::new(9);
        let sampling = Sampling {
            max_new_tokens: 1,
            temperature: 2.0,
            top_k: Some(3),
            seed: 0,
            kv_cache: true,
        };
        for _ in 0..200 {
            assert!([0, 1, 3].contains(&pick(&logits, &sampling, &mut rng)));
        }
    }
}
