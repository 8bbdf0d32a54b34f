//! The Llama model kind (`model.preset = "llama-tiny"`): it learns on the bundled corpus, and the
//! parallel layouts the GPT has train it like serial training, with no parallel code of its own:
//! its tensor-parallel plan is rules in the model's plan table, its pipeline split the GPT's.
//!
//! Exactness, as for the GPT (the module docs of `data_parallel`, `pipeline` and
//! `tensor_parallel` give the arguments): DDP with one micro-batch per rank and pipelines with
//! untied embeddings (llama-tiny's head is untied) are bitwise serial training; ZeRO 3 against
//! DDP and tensor parallelism against serial are within the GPT's bounds (for the untied model:
//! 1e-5 relative for ZeRO 3, [`SUMMATION_ORDER`] for tensor parallelism).

use burn::backend::Flex;
use burn::module::{Module, Param};
use burn::tensor::{Int, Tensor, TensorData};
use wildfire_backend::compare::max_abs_difference;
use wildfire_recipes::data::TokenizerKind;
use wildfire_recipes::hf::{self, files, names};
use wildfire_recipes::model::params::collect_params;
use wildfire_recipes::model::{Gpt, GptConfig, Llama3Scaling, ModelKind, Preset, StageSpec};
use wildfire_recipes::{CpuBackend, checkpoint};

use crate::common::*;

const LLAMA: [&str; 2] = ["--set", "model.preset=\"llama-tiny\""];
const SAVE_EVERY_STEP: [&str; 4] = [
    "--set",
    "checkpoint.every=1",
    "--set",
    "checkpoint.keep_last=0",
];

/// llama-tiny (the base arguments: context 32, 4 micro-batches of 2, 10 steps) with `extra`,
/// keeping every step's checkpoint; `--microbatches N` in `extra` replaces the base's 4.
fn llama_args(dir: &std::path::Path, extra: &[&str]) -> Vec<String> {
    base_args_with(dir, &[&LLAMA[..], &SAVE_EVERY_STEP, extra].concat())
}

/// A run of llama-tiny in one process (ranks as threads where `extra` asks for them).
fn llama_run(name: &str, extra: &[&str]) -> RunDir {
    let dir = run_dir(name);
    let args = llama_args(&dir, extra);
    let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
    assert!(out.status.success(), "{args:?}:\n{}", text(&out));
    dir
}

/// The default recipe with the Llama model for 200 steps learns as the GPT does
/// ([`assert_learns_the_corpus`]), and generates the same text with and without its cache.
#[test]
fn llama_tiny_learns_on_the_bundled_corpus() {
    let dir = run_dir("llama-default");
    let sets = [
        format!("run.dir={}", dir.display()),
        format!("data.path={CORPUS}"),
        "model.preset=\"llama-tiny\"".into(),
        "train.max_steps=200".into(),
        "run.log_every=100".into(),
    ];
    let mut args = vec!["train".to_string()];
    for set in sets {
        args.extend(["--set".to_string(), set]);
    }
    let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("training a llama of 807040 parameters"),
        "{}",
        text(&out)
    );
    assert_learns_the_corpus(&series(&dir, "train", "loss"));

    assert_cache_generates_as_full_recompute(&dir);
}

/// Greedy generation of 150 tokens from a 6-token prompt (past the context of 128, where the
/// cached path falls back to windows) is the same text with the key/value cache and without.
pub fn assert_cache_generates_as_full_recompute(dir: &std::path::Path) {
    let generate = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--checkpoint",
            dir.to_str().unwrap(),
            "--prompt",
            "ROMEO:",
            "--max-new-tokens",
            "150",
            "--temperature",
            "0",
        ];
        args.extend(extra);
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let cached = generate(&[]);
    assert_eq!(
        cached.trim_end_matches('\n').chars().count(),
        156,
        "{cached:?}"
    );
    assert_eq!(
        cached,
        generate(&["--no-kv-cache"]),
        "with and without the cache"
    );
}

/// llama-tiny with Llama 3's RoPE (θ = 500,000, the frequencies scaled by 8 from a context of
/// 16), trained for 20 steps.
fn llama3_rope_run(name: &str) -> RunDir {
    let rope = [
        "--set",
        "model.rope_theta=500000",
        "--set",
        "model.rope_scaling.factor=8.0",
        "--set",
        "model.rope_scaling.low_freq_factor=1.0",
        "--set",
        "model.rope_scaling.high_freq_factor=4.0",
        "--set",
        "model.rope_scaling.original_context=16",
    ];
    llama_run(
        name,
        &[&rope[..], &["--set", "train.max_steps=20"]].concat(),
    )
}

/// A trained llama-tiny with Llama 3's RoPE (θ = 500,000, the frequencies scaled by 8 from a
/// context of 16) exported as Hugging Face weights, in one file and in shards of at most 1 MB
/// (4 shards of its 3.2 MB), holds every parameter bitwise under Hugging Face's names and
/// layouts, and imports back bitwise; `--init-from hf:DIR` takes the sizes and the RoPE from the
/// directory's config.json (written as transformers 5 writes it, `rope_parameters`) and starts
/// where the trained model ended.
#[test]
fn llama_hugging_face_weights_round_trip() {
    let trained = llama3_rope_run("llama-hf-trained");
    let ours = params(&trained);
    let config = GptConfig {
        context: 32,
        rope_theta: 500_000.0,
        rope_scaling: Some(Llama3Scaling {
            original_context: 16,
            ..Llama3Scaling::llama3(8.0)
        }),
        ..Preset::LlamaTiny.config(76)
    };
    for (name, shard, files) in [("single", "5GB", 1), ("sharded", "1MB", 4)] {
        let out = trained.join(format!("hf-{name}"));
        export_hf(&trained, &out, Some(shard));
        let written = std::fs::read_dir(&out)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().path().extension().unwrap() == "safetensors")
            .count();
        assert_eq!(written, files, "{name}: safetensors files");
        assert_eq!(
            out.join(files::INDEX_FILE).exists(),
            files > 1,
            "{name}: index"
        );

        let theirs = files::read_tensors(&out).unwrap();
        assert_eq!(theirs.len(), ours.len(), "{name}: tensor count");
        for (param, data) in &ours {
            let hf = names::hf_name(ModelKind::Llama, param);
            let stored = &theirs[&hf];
            let expected = match names::is_transposed(ModelKind::Llama, &hf) {
                true => {
                    let [rows, cols] = [data.shape[0], data.shape[1]];
                    let values: Vec<f32> = data.to_vec().unwrap();
                    let t: Vec<f32> = (0..cols * rows)
                        .map(|i| values[(i % rows) * cols + i / rows])
                        .collect();
                    TensorData::new(t, [cols, rows])
                }
                false => data.clone(),
            };
            assert_eq!(stored, &expected, "{name}: {param} as {hf}");
        }

        let fresh = Gpt::<Flex>::new(&config, StageSpec::whole(&config), &Default::default());
        let imported = hf::import(fresh, &config, &out).unwrap();
        let back: std::collections::BTreeMap<String, TensorData> = collect_params(&imported, 0)
            .into_iter()
            .map(|(n, _, d)| (n, d))
            .collect();
        assert_eq!(back, ours, "{name}: imported parameters");
    }

    let sharded = trained.join("hf-sharded");
    let from_hf = run_dir("llama-init-from-hf");
    let mut args = base_args(&from_hf);
    let source = format!("hf:{}", sharded.display());
    args.extend([
        "--init-from".into(),
        source,
        "--set".into(),
        "train.max_steps=1".into(),
    ]);
    let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("training a llama of 807040 parameters"),
        "{}",
        text(&out)
    );
    let (first, last) = (
        series(&from_hf, "train", "loss")[0],
        *series(&trained, "train", "loss").last().unwrap(),
    );
    assert!(
        (first - last).abs() < 0.3 && first < 3.5,
        "the imported model starts at {first}; the trained one ended at {last}"
    );
}

/// Hugging Face transformers loads llama-tiny with Llama 3's RoPE, exported in shards, as
/// LlamaForCausalLM with our logits (within 1e-4: the two sum in different orders) and our
/// greedy continuation, token for token.
#[test]
#[ignore = "needs python3 with torch and transformers"]
fn llama_export_loads_in_transformers_with_the_same_logits() {
    let trained = llama3_rope_run("llama-hf-transformers");
    let sharded = trained.join("hf-sharded");
    export_hf(&trained, &sharded, Some("1MB"));
    let prompt = [20, 47, 56, 57, 58, 1, 15, 47];
    assert_transformers_computes_ours(&trained, &sharded, &prompt, 12);
}

/// `wildfire` with `args`; its standard output (the run must succeed).
fn wildfire(args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
    assert!(out.status.success(), "{args:?}:\n{}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// llama-tiny with a Hugging Face tokenizer (a Llama-3-style tokenizer.json of 512 ids): the
/// checkpoint carries the tokenizer, so generation needs no file once trained; export writes it
/// beside the weights, and `generate --init-from hf:DIR` from the export continues a prompt as
/// the checkpoint does. Without a tokenizer.json the export of a model that is not GPT-2 is
/// refused, naming the directory.
#[test]
fn llama_with_a_hugging_face_tokenizer_trains_exports_and_generates() {
    let tokenizer_dir = run_dir("llama-tokenizer-json");
    let json = std::fs::read_to_string(llama3_style_tokenizer(&tokenizer_dir, 512)).unwrap();
    let flag = format!("hf:{}", tokenizer_dir.display());
    let trained = llama_run("llama-hf-tokenizer", &["--tokenizer", &flag]);
    drop(tokenizer_dir);
    let loaded = checkpoint::load(&checkpoint::resolve(&trained).unwrap()).unwrap();
    assert_eq!(loaded.state.tokenizer, TokenizerKind::Hf);
    assert_eq!(
        loaded.state.vocab, json,
        "the checkpoint keeps the tokenizer.json"
    );
    assert_eq!(loaded.state.model.vocab_size, 512);

    let trained_dir = trained.to_str().unwrap();
    let greedy = [
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "20",
        "--temperature",
        "0",
    ];
    let from_checkpoint =
        wildfire(&[&["generate", "--checkpoint", trained_dir], &greedy[..]].concat());
    assert!(
        from_checkpoint.starts_with("ROMEO:") && from_checkpoint.len() > 20,
        "{from_checkpoint:?}"
    );

    let export = trained.join("hf");
    let export_dir = export.to_str().unwrap();
    export_hf(&trained, &export, None);
    let exported = std::fs::read_to_string(export.join("tokenizer.json")).unwrap();
    assert_eq!(exported, json, "the export's tokenizer.json");
    let source = format!("hf:{export_dir}");
    let from_export = wildfire(&[&["generate", "--init-from", &source], &greedy[..]].concat());
    assert_eq!(
        from_export, from_checkpoint,
        "from the export and from the checkpoint"
    );

    std::fs::remove_file(export.join("tokenizer.json")).unwrap();
    let args: Vec<String> = [&["generate", "--init-from", &source], &greedy[..]]
        .concat()
        .iter()
        .map(|s| s.to_string())
        .collect();
    let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
    assert!(!out.status.success());
    let expected = format!("{export_dir} has no tokenizer.json, and its llama of 512 tokens");
    assert!(text(&out).contains(&expected), "{}", text(&out));
}

/// DDP (4 thread ranks, one micro-batch each) and a 2-stage pipeline (1F1B, thread ranks)
/// train bitwise like serial training; ZeRO 3 at dp 2 like DDP at dp 2 within 1e-5; tensor
/// parallelism with sequence parallelism (processes) like serial within [`SUMMATION_ORDER`],
/// at tp 2 (each rank holds one of the 2 key/value heads) and at tp 4 (ranks 0–1 share key/value
/// head 0, ranks 2–3 head 1). 10 steps, parameters compared after every step.
#[test]
fn llama_trains_like_serial_under_every_layout() {
    let serial = llama_run("llama-serial", &[]);
    let local = ["--transport", "local"];

    let ddp4 = llama_run(
        "llama-ddp4",
        &[&local[..], &["--dp", "4", "--microbatches", "1"]].concat(),
    );
    assert_same_training(&serial, &ddp4, "llama ddp 4", 0.0);

    let pipeline = llama_run("llama-pp2", &[&local[..], &["--pp", "2"]].concat());
    assert_same_training(&serial, &pipeline, "llama pp 2", 0.0);

    let dp2 = [&local[..], &["--dp", "2", "--microbatches", "2"]].concat();
    let ddp2 = llama_run("llama-ddp2", &dp2);
    let zero3 = llama_run("llama-zero3", &[&dp2[..], &["--zero", "3"]].concat());
    assert_same_training(&ddp2, &zero3, "llama zero 3 against ddp 2", 1e-5);

    let dir = run_dir("llama-tp2-sp");
    let args = llama_args(&dir, &["--tp", "2", "--sequence-parallel"]);
    let out = launch(2, 29740, &args);
    assert!(out.status.success(), "{args:?}:\n{}", text(&out));
    assert_trains_like(&serial, &dir, "llama tp 2 sp");

    let dir = run_dir("llama-tp4-sp");
    let args = llama_args(&dir, &["--tp", "4", "--sequence-parallel"]);
    let out = launch(4, 29743, &args);
    assert!(out.status.success(), "{args:?}:\n{}", text(&out));
    assert_trains_like(&serial, &dir, "llama tp 4 sp, key/value heads shared");
}

/// Llama's block with every setting its families add: heads set apart from the width (4 heads of
/// 48 on a width of 128, as Qwen3 and Mistral-Nemo have them), biases on Q, K and V alone
/// (Qwen2), an RMSNorm of each head of Q and K (Qwen3) and a sliding window (Mistral; 8 keys of
/// the 32-token windows trained on). The plan splits the projections and their biases by heads
/// as it does Llama's, sums the head norms' gradients over the tensor-parallel group (each rank
/// normalises its own heads), and the window is the same for every head and applies where the
/// sequence is whole, so a 2-stage pipeline trains bitwise like serial training and tensor
/// parallelism with sequence parallelism like serial within [`SUMMATION_ORDER`].
#[test]
fn llama_with_its_families_settings_trains_like_serial_when_split() {
    let shape = [
        "--set",
        "model.head_dim=48",
        "--set",
        "model.qkv_bias=true",
        "--set",
        "model.sliding_window=8",
        "--set",
        "model.qk_norm=true",
    ];
    let serial = llama_run("qwen-shape-serial", &shape);
    let trained = params(&serial);
    assert_eq!(
        trained["blocks.0.attn.q_proj.weight"].shape.to_vec(),
        [128, 192]
    );
    assert!(trained.contains_key("blocks.0.attn.k_proj.bias"));
    assert!(!trained.contains_key("blocks.0.attn.c_proj.bias"));
    assert_eq!(trained["blocks.0.attn.q_norm.gamma"].shape.to_vec(), [48]);

    let pp2 = [&shape[..], &["--transport", "local", "--pp", "2"]].concat();
    let pipeline = llama_run("qwen-shape-pp2", &pp2);
    assert_same_training(&serial, &pipeline, "family settings: pp 2", 0.0);

    let dir = run_dir("qwen-shape-tp2-sp");
    let args = llama_args(
        &dir,
        &[&shape[..], &["--tp", "2", "--sequence-parallel"]].concat(),
    );
    let out = launch(2, 29746, &args);
    assert!(out.status.success(), "{args:?}:\n{}", text(&out));
    assert_trains_like(&serial, &dir, "family settings: tp 2 sp");
}

/// Layouts the Llama model cannot take are refused before training, naming the numbers.
#[test]
fn llama_layouts_it_cannot_split_are_named() {
    assert_refused(
        "llama-refused",
        &[
            (
                &[
                    "--set",
                    "model.preset=\"llama-tiny\"",
                    "--set",
                    "model.n_kv_head=3",
                ],
                "model.n_head = 4 is not divisible by model.n_kv_head = 3",
            ),
            (
                &[
                    "--set",
                    "model.preset=\"tiny\"",
                    "--set",
                    "model.kind=\"llama\"",
                ],
                "model.kind = \"llama\" contradicts model.preset = \"tiny\", a gpt model",
            ),
            (
                &["--set", "model.n_kv_head=2"],
                "grouped-query attention needs model.kind = \"llama\"",
            ),
        ],
    );
    // 3 key/value heads over 2 ranks: neither whole heads per rank nor a head shared by ranks.
    let dir = run_dir("llama-refused-kv3-tp2");
    let sizes = [
        "--set",
        "model.n_head=6",
        "--set",
        "model.n_kv_head=3",
        "--set",
        "model.d_model=96",
        "--tp",
        "2",
    ];
    let out = launch(2, 29744, &llama_args(&dir, &sizes));
    assert!(!out.status.success(), "3 key/value heads at tp 2 succeeded");
    let expected = "model.n_kv_head = 3 and parallel.tp = 2 do not divide one another";
    assert!(text(&out).contains(expected), "{}", text(&out));
    assert!(
        !dir.join("metrics.jsonl").exists(),
        "the refused run wrote metrics"
    );
}

/// Llama 3's published sizes, and every built model's parameters counted as the formula does.
#[test]
fn llama_parameter_counts_match_the_published_models() {
    assert_eq!(
        Preset::Llama1b.config(128_256).parameter_count(),
        1_235_814_400
    );
    assert_eq!(
        Preset::Llama8b.config(128_256).parameter_count(),
        8_030_261_248
    );
    let tiny = Preset::LlamaTiny.config(76);
    for config in [
        tiny.clone(),
        GptConfig {
            tie_embeddings: true,
            bias: true,
            ..tiny
        },
    ] {
        let model = Gpt::<Flex>::new(&config, StageSpec::whole(&config), &Default::default());
        assert_eq!(model.num_params(), config.parameter_count(), "{config:?}");
    }
}

/// Grouped-query attention against the same attention with every key/value head written out:
/// a model with `n_kv_head` = 1 or 2 (of 4 heads) gives the logits of the `n_kv_head = n_head`
/// model whose K and V projections repeat each group's columns for the query heads it serves
/// (head `h` uses key/value head `h / (n_head / n_kv_head)`).
#[test]
fn grouped_query_attention_equals_attention_with_repeated_heads() {
    let device = Default::default();
    let tokens = Tensor::<CpuBackend, 1, Int>::arange(0..24, &device)
        .remainder_scalar(50)
        .reshape([2, 12]);
    for n_kv_head in [1, 2] {
        let config = GptConfig {
            vocab_size: 50,
            n_layer: 2,
            n_kv_head,
            context: 16,
            ..Preset::LlamaTiny.config(50)
        };
        assert_eq!(config.kind, ModelKind::Llama);
        let grouped = Gpt::<CpuBackend>::new(&config, StageSpec::whole(&config), &device);
        let full_config = GptConfig {
            n_kv_head: config.n_head,
            ..config.clone()
        };
        let mut full = grouped.clone();
        let (group, d_head) = (config.n_head / n_kv_head, config.head_dim());
        for block in &mut full.blocks {
            for projection in [&mut block.attn.k_proj, &mut block.attn.v_proj] {
                let layer = projection.as_mut().expect("Llama has K and V projections");
                let weight = layer.weight.val();
                let heads: Vec<_> = (0..config.n_head)
                    .map(|h| weight.clone().narrow(1, h / group * d_head, d_head))
                    .collect();
                layer.weight = Param::from_tensor(Tensor::cat(heads, 1));
            }
            block.attn.n_kv_head = full_config.n_kv_head;
        }
        let expected: Vec<f32> = full.forward(tokens.clone()).into_data().to_vec().unwrap();
        let got: Vec<f32> = grouped
            .forward(tokens.clone())
            .into_data()
            .to_vec()
            .unwrap();
        let worst = max_abs_difference(&expected, &got);
        assert!(
            worst <= 1e-6,
            "n_kv_head {n_kv_head}: logits {worst:e} apart"
        );
    }
}
