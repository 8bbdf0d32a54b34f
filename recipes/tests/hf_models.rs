//! Hugging Face models of each family wildfire reads, against what transformers computes with
//! them. The fixtures under tests/fixtures/hf are tiny models with random weights, written with
//! transformers 5.25.0 by tests/python/make_hf_fixtures.py, beside the logits transformers
//! computed at the prompt's last position and its greedy continuation by 20 tokens: Llama with
//! Llama 3's scaled RoPE in transformers 5's config form and in the older one, Llama with its
//! heads set apart from the width (`head_dim`), Qwen2 (biases on Q, K and V alone, its sliding
//! window switched off), Qwen3 (an RMSNorm of each head of Q and K) and Mistral (a sliding window of 4 keys: the prompt of 8 and its
//! continuation run past it, and the window moves the last logits by 7 in transformers).
//!
//! Each loads through `--init-from hf:DIR`'s reader and gives transformers' logits within 1e-4
//! (the two sum in different orders; a greedy step's top logit leads by at least 1e-3 in every
//! fixture, so the continuation cannot flip within that bound) and its continuation token for
//! token, with and without the key/value cache. Exported back, it is the same config and the
//! same tensors; where transformers is installed, it loads the export as its family's class
//! with our logits at every position (tests/python/check_hf_export.py).

use std::path::{Path, PathBuf};

use burn::tensor::{Int, Tensor, TensorData};
use serde_json::Value;
use wildfire_recipes::CpuBackend;
use wildfire_recipes::data::Tokenizer;
use wildfire_recipes::generate::{Sampling, continue_tokens};
use wildfire_recipes::hf::{self, config, files};
use wildfire_recipes::model::{Gpt, GptConfig, StageSpec};

use crate::common::*;

/// The fixtures, by directory name.
const FAMILIES: [&str; 6] = [
    "llama",
    "llama-older-config",
    "llama-head-dim",
    "qwen2",
    "qwen3",
    "mistral",
];

/// The largest difference allowed between our logits and transformers'.
const LOGITS: f64 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap()
}

fn ids(value: &Value) -> Vec<u32> {
    serde_json::from_value(value.clone()).unwrap()
}

/// Our logits of `prompt`, `[positions][vocab]`.
fn logits(model: &Gpt<CpuBackend>, prompt: &[u32]) -> Vec<Vec<f32>> {
    let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let input = Tensor::<CpuBackend, 2, Int>::from_data(
        TensorData::new(ids, [1, prompt.len()]),
        &Default::default(),
    );
    let logits = model.forward(input);
    let vocab = logits.dims()[2];
    let values: Vec<f32> = logits.into_data().to_vec().unwrap();
    values.chunks(vocab).map(<[f32]>::to_vec).collect()
}

/// Every value of `ours` within [`LOGITS`] of `theirs` (a NaN or a missing value fails).
fn assert_logits(ours: &[f32], theirs: &[f64], what: &str) {
    assert_eq!(ours.len(), theirs.len(), "{what}: vocabulary");
    let worst = (ours.iter().zip(theirs))
        .map(|(a, b)| (*a as f64 - b).abs())
        .fold(
            0.0,
            |worst: f64, d| if d.is_nan() { f64::NAN } else { worst.max(d) },
        );
    println!("{what}: logits {worst:e} apart at worst");
    assert!(worst <= LOGITS, "{what}: logits {worst:e} apart");
}

#[test]
fn every_family_computes_what_transformers_computed() {
    for name in FAMILIES {
        let dir = fixture(name);
        let expected = json(&dir.join("expected.json"));
        let (prompt, greedy) = (ids(&expected["prompt"]), ids(&expected["greedy"]));
        let source = format!("hf:{}", dir.display());
        let config = hf::model_config(&source, 0.0).unwrap().unwrap();
        let fresh = Gpt::<CpuBackend>::new(&config, StageSpec::whole(&config), &Default::default());
        let model = hf::init_from(fresh, &config, &source).unwrap();

        let theirs: Vec<f64> = serde_json::from_value(expected["last_logits"].clone()).unwrap();
        let ours = logits(&model, &prompt);
        assert_logits(ours.last().unwrap(), &theirs, name);
        for kv_cache in [true, false] {
            let sampling = Sampling {
                max_new_tokens: greedy.len(),
                temperature: 0.0,
                top_k: None,
                seed: 0,
                kv_cache,
            };
            let vocab = config.vocab_size;
            let tokens = continue_tokens(&model, prompt.clone(), &sampling, config.context, vocab);
            assert_eq!(
                tokens.unwrap()[prompt.len()..],
                greedy,
                "{name}: greedy continuation, key/value cache {kv_cache}"
            );
        }
        exports_as_it_came(name, &model, &config, &prompt, &ours);
    }
}

/// `model` (the fixture `name`) exported: the fixture's config and tensors again, and, where
/// transformers is installed, its logits of `prompt`, `ours`, from transformers' class of the
/// family.
fn exports_as_it_came(
    name: &str,
    model: &Gpt<CpuBackend>,
    config: &GptConfig,
    prompt: &[u32],
    ours: &[Vec<f32>],
) {
    let out = run_dir(&format!("hf-family-{name}"));
    let tokenizer = Tokenizer::from_chars("ab");
    hf::export(model, config, &tokenizer, &out, u64::MAX).unwrap();
    let written = json(&out.join("config.json"));
    assert_eq!(
        config::from_json(&written, 0.0).unwrap(),
        *config,
        "{name}: exported config"
    );
    let model_type = json(&fixture(name).join("config.json"))["model_type"].clone();
    assert_eq!(written["model_type"], model_type, "{name}: model_type");
    assert_eq!(
        files::read_tensors(&out).unwrap(),
        files::read_tensors(&fixture(name)).unwrap(),
        "{name}: exported tensors"
    );

    let mut args = vec![out.to_str().unwrap().to_string(), "0".to_string()];
    args.extend(prompt.iter().map(u32::to_string));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let Some(check) = python("check_hf_export.py", &args) else {
        return;
    };
    assert!(
        check.status.success(),
        "{name}: transformers:\n{}",
        text(&check)
    );
    let theirs: Value = serde_json::from_slice(&check.stdout).unwrap();
    let theirs: Vec<Vec<f64>> = serde_json::from_value(theirs["logits"].clone()).unwrap();
    assert_eq!(theirs.len(), ours.len(), "{name}: positions");
    let what = format!("{name} exported, every position");
    assert_logits(&ours.concat(), &theirs.concat(), &what);
}
