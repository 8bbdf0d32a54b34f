//! Hugging Face models of each family wildfire reads, against what transformers computes with
//! them. The fixtures under tests/fixtures/hf are tiny models with random weights and their
//! family's tokenizer, written with transformers 5.25.0 by tests/python/make_hf_fixtures.py,
//! beside the logits transformers computed at the prompt's last position, its greedy
//! continuation by 20 tokens, and the text transformers decodes from a text prompt and its greedy
//! continuation. The models: Llama with Llama 3's scaled RoPE in transformers 5's config form and
//! in the older one, Llama with its heads set apart from the width (`head_dim`), Qwen2 (biases on
//! Q, K and V alone, its sliding window switched off), Qwen3 (an RMSNorm of each head of Q and K)
//! and Mistral (a sliding window of 4 keys: the prompt of 8 and its continuation run past it, and
//! the window moves the last logits by 7 in transformers). The tokenizers, each built by
//! transformers' class of its design: Llama 3's byte-level BPE for the Llama fixtures, Qwen's
//! (NFC, its own pattern, byte-level BPE) for Qwen2 and Qwen3, and Mistral's SentencePiece-style
//! BPE (`▁` for spaces, byte fallback).
//!
//! Each loads through `--init-from hf:DIR`'s reader and gives transformers' logits within 1e-4
//! (the two sum in different orders; a greedy step's top logit leads by at least 1e-3 in every
//! fixture, so the continuation cannot flip within that bound) and its continuation token for
//! token, with and without the key/value cache. `wildfire generate --init-from hf:DIR` encodes
//! the text prompt to transformers' ids and writes transformers' text. Exported back, it is the
//! same config, the same tensors and the same tokenizer.json, and generates the same text; and (an
//! ignored test, for where transformers is installed) transformers loads the export as its
//! family's class with our logits at every position (tests/python/check_hf_export.py), and its
//! tokenizer of the export encodes the prompt to our ids and decodes our ids to our text
//! (tests/python/check_hf_tokenizer.py).

use std::path::{Path, PathBuf};
use wildfire_backend::compare::max_abs_difference;

use burn::tensor::{Int, Tensor, TensorData};
use serde_json::Value;
use wildfire_recipes::CpuBackend;
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
    let ours: Vec<f64> = ours.iter().map(|&x| f64::from(x)).collect();
    let worst = max_abs_difference(&ours, theirs);
    println!("{what}: logits {worst:e} apart at worst");
    assert!(worst <= LOGITS, "{what}: logits {worst:e} apart");
}

/// The fixture `name`'s model, loaded through `--init-from hf:DIR`'s reader, with its config and
/// what transformers computed with it (expected.json).
fn family(name: &str) -> (Gpt<CpuBackend>, GptConfig, Value) {
    let dir = fixture(name);
    let expected = json(&dir.join("expected.json"));
    let source = format!("hf:{}", dir.display());
    let config = hf::model_config(&source, 0.0).unwrap().unwrap();
    let fresh = Gpt::<CpuBackend>::new(&config, StageSpec::whole(&config), &Default::default());
    let model = hf::init_from(fresh, &config, &source).unwrap();
    (model, config, expected)
}

#[test]
fn every_family_computes_what_transformers_computed() {
    for name in FAMILIES {
        let dir = fixture(name);
        let (model, config, expected) = family(name);
        let (prompt, greedy) = (ids(&expected["prompt"]), ids(&expected["greedy"]));

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
        let text_prompt = &expected["text"];
        writes_transformers_text(name, &dir, text_prompt);
        let out = exports_as_it_came(name, &model, &config, "hf-family");
        writes_transformers_text(&format!("{name} exported"), &out, text_prompt);
    }
}

/// Every family's export loads in transformers as its family's class with our logits at every
/// position (tests/python/check_hf_export.py), and transformers' tokenizer of the export encodes
/// the text prompt to our ids and decodes our ids to our text (tests/python/check_hf_tokenizer.py).
#[test]
#[ignore = "needs python3 with torch and transformers"]
fn every_family_exported_loads_in_transformers() {
    for name in FAMILIES {
        let (model, config, expected) = family(name);
        let prompt = ids(&expected["prompt"]);
        let ours = logits(&model, &prompt);
        let out = exports_as_it_came(name, &model, &config, "hf-family-transformers");
        let tokenizer = hf::tokenizer(&out, &config).unwrap();

        let mut args = vec![out.to_str().unwrap().to_string(), "0".to_string()];
        args.extend(prompt.iter().map(u32::to_string));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let check = python_required("check_hf_export.py", &args);
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

        let text_prompt = &expected["text"];
        let text_ids = [ids(&text_prompt["ids"]), ids(&text_prompt["greedy"])].concat();
        let text_file = out.join("prompt.txt");
        std::fs::write(&text_file, text_prompt["prompt"].as_str().unwrap()).unwrap();
        let mut args = vec![
            out.to_str().unwrap().to_string(),
            text_file.to_str().unwrap().to_string(),
        ];
        args.extend(text_ids.iter().map(u32::to_string));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let check = python_required("check_hf_tokenizer.py", &args);
        assert!(
            check.status.success(),
            "{name}: transformers' tokenizer:\n{}",
            text(&check)
        );
        let theirs: Value = serde_json::from_slice(&check.stdout).unwrap();
        assert_eq!(
            ids(&theirs["ids"]),
            tokenizer
                .encode(text_prompt["prompt"].as_str().unwrap())
                .unwrap(),
            "{name} exported: transformers' ids of the text prompt"
        );
        assert_eq!(
            theirs["decoded"].as_str().unwrap(),
            tokenizer.decode(&text_ids).unwrap(),
            "{name} exported: transformers' text of the prompt and its continuation"
        );
    }
}

/// `wildfire generate --init-from hf:DIR` from the text prompt of `expected` (a fixture's
/// `text`): the prompt encodes to transformers' ids, and greedy generation writes the text
/// transformers decoded from them and its continuation.
fn writes_transformers_text(name: &str, dir: &Path, expected: &Value) {
    let prompt = expected["prompt"].as_str().unwrap();
    let source = format!("hf:{}", dir.display());
    let config = hf::model_config(&source, 0.0).unwrap().unwrap();
    let tokenizer = hf::tokenizer(dir, &config).unwrap();
    assert_eq!(
        tokenizer.encode(prompt).unwrap(),
        ids(&expected["ids"]),
        "{name}: the ids of {prompt:?}"
    );
    let new_tokens = ids(&expected["greedy"]).len().to_string();
    let args = [
        "generate",
        "--init-from",
        &source,
        "--prompt",
        prompt,
        "--max-new-tokens",
        &new_tokens,
        "--temperature",
        "0",
    ]
    .map(str::to_string);
    let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
    assert!(out.status.success(), "{name}: generate:\n{}", text(&out));
    let decoded = expected["decoded"].as_str().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("{decoded}\n"),
        "{name}: the text generated from {prompt:?}"
    );
}

/// `model` (the fixture `name`) exported with the fixture's tokenizer: the fixture's config,
/// tensors and tokenizer.json again. Returns the export's directory, `dir_name-name` under the
/// temporary directory.
fn exports_as_it_came(
    name: &str,
    model: &Gpt<CpuBackend>,
    config: &GptConfig,
    dir_name: &str,
) -> RunDir {
    let out = run_dir(&format!("{dir_name}-{name}"));
    let tokenizer = hf::tokenizer(&fixture(name), config).unwrap();
    hf::export(model, config, &tokenizer, &out, u64::MAX).unwrap();
    let tokenizer_json = |dir: &Path| std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
    assert_eq!(
        tokenizer_json(&out),
        tokenizer_json(&fixture(name)),
        "{name}: exported tokenizer.json"
    );
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

    out
}
