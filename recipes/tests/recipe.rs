//! The training recipe as a user runs it: `wildfire train | generate | export` on the bundled
//! corpus, checked through the run directory's files (metrics.jsonl, the event file,
//! checkpoints). Each test uses its own run directory.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Output;

use crate::common::{
    CORPUS, assert_transformers_computes_ours, export_hf, python, run_dir,
    wildfire_output as wildfire,
};
use burn::backend::Flex;
use serde_json::Value;

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `wildfire train` with `flags`, the default config plus `overrides` (and this test's run
/// dir, the absolute corpus path); its output.
fn train_with(dir: &Path, overrides: &[&str], flags: &[&str]) -> Output {
    let mut args: Vec<String> = ["train"]
        .iter()
        .chain(flags)
        .map(|s| s.to_string())
        .collect();
    let dir_set = format!("run.dir={}", dir.display());
    let corpus_set = format!("data.path={CORPUS}");
    for o in [dir_set.as_str(), corpus_set.as_str()]
        .into_iter()
        .chain(overrides.iter().copied())
    {
        args.push("--set".into());
        args.push(o.to_string());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    wildfire(&args)
}

/// [`train_with`] (`--resume` when `resume`), which must succeed.
fn train(dir: &Path, overrides: &[&str], resume: bool) -> Output {
    let flags: &[&str] = if resume { &["--resume"] } else { &[] };
    let out = train_with(dir, overrides, flags);
    assert!(
        out.status.success(),
        "wildfire train failed:\n{}",
        text(&out)
    );
    out
}

/// A small, quick variant of the default recipe (context 32, batches of 4).
const SMALL: &[&str] = &[
    "model.context=32",
    "train.micro_batch=4",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.warmup_steps=2",
    "checkpoint.every=0",
];

fn with(base: &[&'static str], extra: &[&'static str]) -> Vec<&'static str> {
    base.iter().chain(extra).copied().collect()
}

fn metrics(dir: &Path, kind: &str) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("json line"))
        .filter(|v| v["kind"] == kind)
        .collect()
}

fn losses(dir: &Path) -> Vec<f64> {
    metrics(dir, "train")
        .iter()
        .map(|v| v["loss"].as_f64().expect("loss"))
        .collect()
}

/// The default recipe for 200 steps learns ([`crate::common::assert_learns_the_corpus`]:
/// from ≈ ln(76) to a mean below 2.6 over the last 10 steps). The event file holds
/// the same numbers for TensorBoard's reader, and generation from the checkpoint is repeatable.
#[test]
fn default_recipe_learns_and_logs_for_tensorboard() {
    let dir = run_dir("default");
    let out = train(&dir, &["train.max_steps=200", "run.log_every=50"], false);
    crate::common::assert_learns_the_corpus(&losses(&dir));
    assert!(text(&out).contains("step 50/200 | "), "{}", text(&out));
    let evals = metrics(&dir, "eval");
    assert_eq!(evals.len(), 1, "the last step evaluates");
    assert!(dir.join("config.json").exists());

    if let Some(check) = python("check_tensorboard.py", &[dir.to_str().unwrap()]) {
        assert!(
            check.status.success(),
            "TensorBoard's reader disagrees:\n{}",
            text(&check)
        );
    }

    let dir_arg = dir.to_str().unwrap();
    let sample = |seed: &str| {
        let out = wildfire(&[
            "generate",
            "--checkpoint",
            dir_arg,
            "--prompt",
            "ROMEO:",
            "--max-new-tokens",
            "40",
            "--seed",
            seed,
        ]);
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let first = sample("7");
    // One character per token: the prompt's 6, then 40 sampled (plus println's newline).
    let generated = first.strip_suffix('\n').unwrap_or(&first);
    assert!(
        generated.starts_with("ROMEO:") && generated.chars().count() == 46,
        "{first:?}"
    );
    assert_eq!(first, sample("7"), "same seed, same text");
    crate::llama::assert_cache_generates_as_full_recompute(&dir);
}

/// 2N steps in one go against N steps, then a resume for N more: the same losses, bitwise. The
/// interrupted run is the uninterrupted one with its later checkpoint deleted, so the resume
/// starts from the step-N checkpoint a killed run would have left. Dropout and gradient
/// accumulation are on, so the RNG and the data cursor must both be restored.
#[test]
fn resume_continues_bitwise() {
    let dir = run_dir("resume");
    let config = with(
        SMALL,
        &[
            "train.max_steps=6",
            "checkpoint.every=3",
            "checkpoint.keep_last=0",
            "model.dropout=0.1",
            "train.grad_accum=2",
        ],
    );
    train(&dir, &config, false);
    let uninterrupted = losses(&dir);
    assert_eq!(uninterrupted.len(), 6);
    crate::common::remove_checkpoints(&dir, 6..=6);
    let out = train(&dir, &config, true);
    assert!(text(&out).contains("steps 3..6"), "{}", text(&out));
    let all = losses(&dir);
    assert_eq!(
        all.len(),
        6,
        "the records of steps 3..6 are replaced by the resumed run's"
    );
    assert_eq!(
        all, uninterrupted,
        "resumed losses differ from the uninterrupted run"
    );
}

/// The event files in `dir`.
fn event_files(dir: &Path) -> usize {
    (std::fs::read_dir(dir).unwrap())
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().starts_with("events.out.tfevents.")
        })
        .count()
}

/// The same command twice: the second continues the run it finds, here already finished (it
/// says so and exits 0, leaving the records as they were); another config in that directory is
/// refused, and `--resume` with a larger `train.max_steps` trains on.
#[test]
fn the_same_command_twice_finds_its_run_finished() {
    let dir = run_dir("twice");
    let config = with(SMALL, &["train.max_steps=2", "train.eval_every=0"]);
    train(&dir, &config, false);
    let first = losses(&dir);
    assert_eq!(first.len(), 2);
    let again = train(&dir, &config, false);
    assert!(
        text(&again).contains("already trained to step 2"),
        "{}",
        text(&again)
    );
    assert_eq!(losses(&dir), first);
    let longer = with(&config, &["train.max_steps=3"]);
    let refused = train_with(&dir, &longer, &[]);
    assert!(!refused.status.success());
    assert!(
        text(&refused).contains("of a run with another config"),
        "{}",
        text(&refused)
    );
    train(&dir, &longer, true);
    assert_eq!(losses(&dir).len(), 3);
}

/// `--resume auto` (what a restarted job runs): before the first checkpoint it starts the run
/// again, replacing the stopped run's metrics and events; after one it continues from it. Both
/// give the uninterrupted run's losses, bitwise.
#[test]
fn resume_auto_restarts_or_continues_bitwise() {
    let dir = run_dir("resume-auto");
    let config = with(
        SMALL,
        &[
            "train.max_steps=4",
            "train.eval_every=0",
            "checkpoint.every=2",
            "checkpoint.keep_last=0",
        ],
    );
    train(&dir, &config, false);
    let uninterrupted = losses(&dir);
    assert_eq!(uninterrupted.len(), 4);
    let resume_auto = |dir: &Path| {
        let out = train_with(dir, &config, &["--resume", "auto"]);
        assert!(out.status.success(), "{}", text(&out));
    };
    // Stopped after its checkpoint at step 2, while saving step 3 (staged, and renamed but not
    // committed): the unfinished saves are removed, the committed checkpoint kept.
    crate::common::remove_checkpoints(&dir, 4..=4);
    let checkpoints = dir.join("checkpoints");
    let unfinished = [
        checkpoints.join(".tmp-step-00000003-4242"),
        checkpoints.join("step-00000003"),
    ];
    for partial in &unfinished {
        std::fs::create_dir_all(partial).unwrap();
        std::fs::write(partial.join("rank-00000.safetensors"), b"partial").unwrap();
    }
    resume_auto(&dir);
    assert_eq!(losses(&dir), uninterrupted, "continued from step 2");
    assert!(
        unfinished.iter().all(|p| !p.exists()),
        "unfinished saves removed"
    );
    assert!(
        checkpoints.join("step-00000002").exists(),
        "committed checkpoint kept"
    );
    // Stopped before any checkpoint: its 4 records and event file are replaced.
    crate::common::remove_checkpoints(&dir, 2..=2);
    crate::common::remove_checkpoints(&dir, 4..=4);
    resume_auto(&dir);
    assert_eq!(losses(&dir), uninterrupted, "started again");
    assert_eq!(
        event_files(&dir),
        1,
        "one event file: the stopped run's were dropped"
    );
    // A directory that does not exist yet: a fresh run.
    let fresh = run_dir("resume-auto-fresh");
    resume_auto(&fresh);
    assert_eq!(losses(&fresh), uninterrupted);
}

/// 4 micro-batches of 4 against 1 batch of 16 on the same windows: the losses of 3 steps and
/// the gradient norms (before clipping, so a wrongly scaled micro-batch loss shows) agree within
/// 1e-5 relative; only the order of summing the gradients differs.
#[test]
fn gradient_accumulation_matches_one_large_batch() {
    let whole = run_dir("accum-1x16");
    let parts = run_dir("accum-4x4");
    train(
        &whole,
        &with(
            SMALL,
            &[
                "train.max_steps=3",
                "train.micro_batch=16",
                "train.grad_accum=1",
            ],
        ),
        false,
    );
    train(
        &parts,
        &with(
            SMALL,
            &[
                "train.max_steps=3",
                "train.micro_batch=4",
                "train.grad_accum=4",
            ],
        ),
        false,
    );
    let (whole, parts) = (metrics(&whole, "train"), metrics(&parts, "train"));
    assert_eq!((whole.len(), parts.len()), (3, 3));
    for (step, (a, b)) in whole.iter().zip(&parts).enumerate() {
        for field in ["loss", "grad_norm"] {
            let (a, b) = (a[field].as_f64().unwrap(), b[field].as_f64().unwrap());
            assert!(
                (a - b).abs() <= 1e-5 * a.abs(),
                "step {step}: {field} 1×16 {a}, 4×4 {b}"
            );
        }
    }
}

/// Bad input gets an error naming the key, path, field or file, and never a partial run.
#[test]
fn bad_input_is_named() {
    let failing = |args: &[&str], expected: &str| {
        let out = wildfire(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            text(&out).contains(expected),
            "{args:?}: expected {expected:?} in\n{}",
            text(&out)
        );
    };
    let dir = run_dir("bad-input");
    let dir_set = format!("run.dir={}", dir.display());
    failing(&["train", "--set", "train.max_stepz=3"], "max_stepz");
    failing(
        &[
            "train",
            "--set",
            &dir_set,
            "--set",
            "data.path=/no/such/corpus.txt",
        ],
        "/no/such/corpus.txt",
    );
    let config_dir = run_dir("bad-input-config");
    std::fs::create_dir_all(&*config_dir).unwrap();
    let config = config_dir.join("config.toml");
    std::fs::write(
        &config,
        wildfire_recipes::config::DEFAULT_CONFIG.replace("max_steps", "#"),
    )
    .unwrap();
    failing(
        &["train", "--config", config.to_str().unwrap()],
        "max_steps",
    );
    failing(
        &["train", "--config", "/no/such/config.toml"],
        "/no/such/config.toml",
    );
    failing(
        &["train", "--set", &dir_set, "--data", "/no/such/dir"],
        "/no/such/dir",
    );
    failing(&["train", "--set", "train.max_steps=abc"], "max_steps");
    failing(
        &["train", "--set", "train.eval_batches=0"],
        "train.eval_batches",
    );
    failing(&["train", "--set", "train.beta2=1.5"], "train.beta2 = 1.5");
    assert!(!dir.exists(), "a refused start created {}", dir.display());

    train(&dir, &with(SMALL, &["train.max_steps=1"]), false);
    let again = ["train", "--set", &dir_set, "--set", "train.max_steps=1"];
    failing(&again, "pass --resume");
    let metrics_only = run_dir("bad-input-metrics");
    std::fs::create_dir_all(&metrics_only).unwrap();
    std::fs::write(metrics_only.join("metrics.jsonl"), "{}\n").unwrap();
    let metrics_only_set = format!("run.dir={}", metrics_only.display());
    failing(
        &["train", "--set", &metrics_only_set],
        "already holds a run's metrics",
    );
    let corpus_set = format!("data.path={CORPUS}");
    let context = "model.context=32";
    let resume_with = |setting: &'static str| {
        let base = [
            "train",
            "--resume",
            "--set",
            &dir_set,
            "--set",
            &corpus_set,
            "--set",
            context,
        ];
        [&base[..], &["--set", setting]].concat()
    };
    failing(
        &resume_with("model.n_layer=2"),
        "model.n_layer is 4 in the checkpoint but 2 in the given config",
    );
    failing(
        &resume_with("train.seed=9"),
        "train.seed changed: it is 1337 in the checkpoint but 9",
    );

    let checkpoint = dir.join("checkpoints/step-00000001");
    let shard = checkpoint.join("rank-00000.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();
    failing(
        &["generate", "--checkpoint", dir.to_str().unwrap()],
        shard.to_str().unwrap(),
    );
    failing(&resume_with("train.max_steps=2"), shard.to_str().unwrap());
}

/// A random GPT-2 file in Hugging Face's layout (`transformer.` prefix or not, Conv1D weights,
/// fused c_attn, mask buffers, a tied or untied lm_head) survives import and export bitwise.
#[test]
fn hf_import_then_export_is_bitwise() {
    for (prefix, tied) in [("transformer.", true), ("", true), ("transformer.", false)] {
        let dir = run_dir(&format!("hf-{}-{tied}", prefix.len()));
        std::fs::create_dir_all(&dir).unwrap();
        let (vocab, context, d, layers) = (50usize, 16usize, 32usize, 2usize);
        let mut rng = wildfire_recipes::data::SplitMix64::new(11);
        let mut tensors: BTreeMap<String, HostTensor> = BTreeMap::new();
        let mut add = |name: String, shape: Vec<usize>| {
            let values = (0..shape.iter().product())
                .map(|_| rng.unit() as f32 - 0.5)
                .collect();
            tensors.insert(name, (shape, values));
        };
        add("wte.weight".into(), vec![vocab, d]);
        add("wpe.weight".into(), vec![context, d]);
        for i in 0..layers {
            for (name, shape) in [
                ("ln_1.weight", vec![d]),
                ("ln_1.bias", vec![d]),
                ("ln_2.weight", vec![d]),
                ("ln_2.bias", vec![d]),
                ("attn.c_attn.weight", vec![d, 3 * d]),
                ("attn.c_attn.bias", vec![3 * d]),
                ("attn.c_proj.weight", vec![d, d]),
                ("attn.c_proj.bias", vec![d]),
                ("mlp.c_fc.weight", vec![d, 4 * d]),
                ("mlp.c_fc.bias", vec![4 * d]),
                ("mlp.c_proj.weight", vec![4 * d, d]),
                ("mlp.c_proj.bias", vec![d]),
            ] {
                add(format!("h.{i}.{name}"), shape);
            }
        }
        add("ln_f.weight".into(), vec![d]);
        add("ln_f.bias".into(), vec![d]);
        if !tied {
            add("lm_head.weight".into(), vec![vocab, d]);
        }
        let mut file_tensors: Vec<(String, HostTensor)> = tensors
            .iter()
            .map(|(k, v)| (format!("{prefix}{k}"), v.clone()))
            .collect();
        for i in 0..layers {
            file_tensors.push((
                format!("{prefix}h.{i}.attn.bias"),
                (vec![1, 1, context, context], vec![1.0; context * context]),
            ));
        }
        let source = dir.join("source.safetensors");
        write_safetensors(&source, &file_tensors);

        let config = wildfire_recipes::model::GptConfig {
            vocab_size: vocab,
            n_layer: layers,
            d_model: d,
            ffn_hidden: 4 * d,
            context,
            tie_embeddings: tied,
            ..wildfire_recipes::model::Preset::Tiny.config(vocab)
        };
        let stage = wildfire_recipes::model::StageSpec::whole(&config);
        let model = wildfire_recipes::model::Gpt::<Flex>::new(&config, stage, &Default::default());
        let model = wildfire_recipes::hf::import(model, &config, &source).expect("import");
        let export = dir.join("export");
        let chars = wildfire_recipes::data::Tokenizer::from_chars("");
        let out = wildfire_recipes::hf::export(&model, &config, &chars, &export, u64::MAX)
            .expect("export");
        let bytes = std::fs::read(&out).unwrap();
        let exported = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(
            exported.len(),
            tensors.len(),
            "no mask buffers, no tied lm_head"
        );
        for (name, (shape, values)) in &tensors {
            let view = exported
                .tensor(name)
                .unwrap_or_else(|_| panic!("{name} missing from the export"));
            assert_eq!(view.shape(), shape.as_slice(), "{name}");
            let expected: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            assert!(
                view.data() == expected.as_slice(),
                "{name} differs after import + export"
            );
        }
        let hf_config: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("export/config.json")).unwrap())
                .unwrap();
        assert_eq!(hf_config["n_embd"], d);
        assert_eq!(hf_config["tie_word_embeddings"], tied);
    }
}

/// A shape and its f32 values, row-major.
type HostTensor = (Vec<usize>, Vec<f32>);

fn write_safetensors(path: &Path, tensors: &[(String, HostTensor)]) {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, (shape, values))| {
            (
                name.clone(),
                shape.clone(),
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(name, shape, data)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A run of 10 steps in `dir` exported with `wildfire export --format hf-safetensors` to
/// `dir/hf`; returns the export's directory.
fn trained_export(dir: &Path) -> std::path::PathBuf {
    train(dir, &with(SMALL, &["train.max_steps=10"]), false);
    let out_dir = dir.join("hf");
    export_hf(dir, &out_dir, None);
    assert!(out_dir.join("model.safetensors").exists() && out_dir.join("config.json").exists());
    out_dir
}

/// `wildfire export --format hf-safetensors` writes a model that `--init-from hf:FILE` starts a
/// new run from, where the trained one ended; sizes that do not match the file are refused.
#[test]
fn export_writes_weights_that_init_from_continues() {
    let dir = run_dir("export");
    let out_dir = trained_export(&dir);

    // `--init-from` starts a new run from the exported weights: its first loss is near the
    // trained model's last one, well below a fresh model's ≈ ln(76) = 4.33.
    let weights = format!("hf:{}", out_dir.join("model.safetensors").display());
    let imported = run_dir("init-from");
    let dir_set = format!("run.dir={}", imported.display());
    let corpus_set = format!("data.path={CORPUS}");
    let settings = with(SMALL, &["train.max_steps=1"]);
    let mut args = vec!["train", "--init-from", weights.as_str()];
    for setting in settings
        .iter()
        .chain([&dir_set.as_str(), &corpus_set.as_str()])
    {
        args.extend(["--set", setting]);
    }
    let out = wildfire(&args);
    assert!(out.status.success(), "{}", text(&out));
    let (first, trained) = (losses(&imported)[0], losses(&dir)[9]);
    assert!(
        first < 4.0 && (first - trained).abs() < 0.3,
        "the imported model starts at {first}; the trained one ended at {trained}"
    );
    // Sizes that do not match the file: an error naming the tensors, and no run directory.
    let mismatched = run_dir("init-from-mismatch");
    let mismatched_set = format!("run.dir={}", mismatched.display());
    args.extend(["--set", "model.n_layer=2", "--set", &mismatched_set]);
    let out = wildfire(&args);
    let message = text(&out);
    assert!(
        !out.status.success() && message.contains("h.2.attn.c_attn.weight"),
        "{message}"
    );
    assert!(
        !mismatched.exists(),
        "a failed start created {}",
        mismatched.display()
    );
}

/// Hugging Face transformers loads the export as GPT2LMHeadModel, with our logits (within 1e-4:
/// PyTorch and the CPU backend sum in different orders) and our greedy continuation.
#[test]
#[ignore = "needs python3 with torch and transformers"]
fn export_loads_in_transformers_with_the_same_logits() {
    let dir = run_dir("export-transformers");
    let out_dir = trained_export(&dir);
    let prompt = [20, 47, 56, 57, 58, 1, 15, 47];
    assert_transformers_computes_ours(&dir, &out_dir, &prompt, 12);
}
