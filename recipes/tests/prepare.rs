//! `wildfire prepare` and training on prepared data: the shards decode back to the input (with
//! each kind of tokenizer), do not depend on the number of threads, refuse bad input without leaving anything behind, and a
//! run on them resumes bitwise and refuses other data.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use wildfire_recipes::data::{
    PrepareOptions, Prepared, Sampler, Split, TokenDtype, Tokenizer, TokenizerKind, Tokens, prepare,
};

use crate::common::{LIMIT, finish, llama3_style_tokenizer, run_dir, spawn, text};

/// A small corpus of three text files (one in a subdirectory) and a JSON-lines file of four
/// documents, in `dir/input`.
fn corpus(dir: &Path) -> PathBuf {
    let input = dir.join("input");
    std::fs::create_dir_all(input.join("more")).unwrap();
    let line = |i: usize| format!("Line {i} of a document, with a comma; and “quotes”.\n");
    let text = |n: usize, from: usize| (from..from + n).map(line).collect::<String>();
    std::fs::write(input.join("a.txt"), text(40, 0)).unwrap();
    std::fs::write(input.join("b.txt"), text(25, 100)).unwrap();
    std::fs::write(input.join("more/c.txt"), text(60, 200)).unwrap();
    let jsonl: String = (0..4)
        .map(|i| {
            serde_json::json!({ "id": i, "text": text(10 + i, 300 + 20 * i) }).to_string() + "\n"
        })
        .collect();
    std::fs::write(input.join("d.jsonl"), jsonl).unwrap();
    input
}

/// The documents of [`corpus`] in input order.
fn documents(input: &Path) -> Vec<String> {
    let read = |name: &str| std::fs::read_to_string(input.join(name)).unwrap();
    let mut docs = vec![read("a.txt"), read("b.txt")];
    let lines = read("d.jsonl");
    let json: Vec<String> = lines
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    docs.extend(json);
    docs.push(read("more/c.txt"));
    docs
}

fn options(input: &Path, out: &Path, tokenizer: TokenizerKind) -> PrepareOptions {
    PrepareOptions {
        inputs: vec![input.to_path_buf()],
        out: out.to_path_buf(),
        tokenizer,
        tokenizer_file: None,
        val_fraction: 0.3,
        seed: 5,
        text_field: "text".into(),
        skip_invalid: false,
        dtype: None,
        // Small shards: documents and windows span shard boundaries.
        shard_tokens: 700,
        progress: false,
    }
}

/// Every file of `dir` by name, with its bytes.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect()
}

/// All of `tokens`.
fn all(tokens: &Tokens) -> Vec<u32> {
    let mut out = Vec::new();
    tokens.extend_from(0, tokens.len(), &mut out);
    out
}

/// `docs` split at `end_of_text`, which ends each.
fn split_documents(text: &str, end_of_text: &str) -> Vec<String> {
    let mut docs: Vec<String> = text.split(end_of_text).map(String::from).collect();
    assert_eq!(
        docs.pop().as_deref(),
        Some(""),
        "the stream ends with an end-of-text"
    );
    docs
}

#[test]
fn prepared_shards_decode_to_the_input_whatever_the_threads() {
    let dir = run_dir("prepare-decode");
    let input = corpus(&dir);
    let expected = documents(&input);
    let hf = llama3_style_tokenizer(&dir.join("hf"), 512);
    for (kind, file, end_of_text) in [
        (TokenizerKind::Char, None, "\u{3}"),
        (TokenizerKind::Gpt2, None, "<|endoftext|>"),
        (TokenizerKind::Hf, Some(&hf), "<|end_of_text|>"),
    ] {
        let outputs: Vec<PathBuf> = [1, 2]
            .into_iter()
            .map(|threads| {
                let out = dir.join(format!("{kind:?}-{threads}-threads"));
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let options = PrepareOptions {
                    tokenizer_file: file.cloned(),
                    ..options(&input, &out, kind)
                };
                pool.install(|| prepare(&options)).unwrap();
                out
            })
            .collect();
        assert_eq!(
            files(&outputs[0]),
            files(&outputs[1]),
            "{kind:?}: 1 and 2 threads"
        );
        let prepared = Prepared::open(&outputs[0]).unwrap();
        let manifest = &prepared.manifest;
        assert!(
            manifest.shards.len() > 2,
            "{kind:?}: several shards: {:?}",
            manifest.shards
        );
        assert_eq!(
            manifest.documents.train + manifest.documents.val,
            expected.len() as u64
        );
        assert!(manifest.documents.val > 0 && manifest.documents.train > 0);
        assert_eq!(manifest.dtype, TokenDtype::U16);
        let tokenizer = Tokenizer::stored(manifest.tokenizer, &manifest.vocab).unwrap();
        let decode = |tokens: &Tokens| tokenizer.decode(&all(tokens)).unwrap();
        let train = split_documents(&decode(&prepared.train), end_of_text);
        let val = split_documents(&decode(&prepared.val), end_of_text);
        // Each split keeps the input's order; together they are the input.
        let mut merged = Vec::new();
        let (mut t, mut v) = (train.iter().peekable(), val.iter().peekable());
        for doc in &expected {
            match (t.peek(), v.peek()) {
                (Some(&next), _) if next == doc => merged.push(t.next().unwrap().clone()),
                (_, Some(&next)) if next == doc => merged.push(v.next().unwrap().clone()),
                _ => panic!("{kind:?}: document {doc:?} is in neither split at its place"),
            }
        }
        assert_eq!(merged, expected, "{kind:?}");
        assert_eq!((t.next(), v.next()), (None, None), "{kind:?}: nothing else");
        // Two data-parallel ranks read disjoint windows that together are the serial batch,
        // and an epoch covers every window once.
        let context = 16;
        let mut serial = Sampler::new(prepared.train.len(), context, 4, 9, (0, 1)).unwrap();
        let mut ranks: Vec<Sampler> = (0..2)
            .map(|r| Sampler::new(prepared.train.len(), context, 4, 9, (r, 2)).unwrap())
            .collect();
        let mut epoch = Vec::new();
        for _ in 0..serial.batches_per_epoch() {
            let whole = serial.next_batch();
            let parts: Vec<usize> = ranks.iter_mut().flat_map(|r| r.next_batch()).collect();
            assert_eq!(
                parts, whole,
                "{kind:?}: the ranks' windows are the serial batch"
            );
            epoch.extend(whole);
        }
        epoch.sort();
        epoch.dedup();
        assert_eq!(
            epoch.len() as u64,
            4 * serial.batches_per_epoch(),
            "{kind:?}: each once"
        );
        // A window across shards reads the same as the stream.
        let stream = all(&prepared.train);
        let mut window = Vec::new();
        prepared.train.extend_from(650, 100, &mut window);
        assert_eq!(window, stream[650..750]);
    }
}

#[test]
fn bad_inputs_are_named_and_leave_nothing_behind() {
    let dir = run_dir("prepare-bad");
    let input = corpus(&dir);
    let out = dir.join("out");
    let refused = |options: &PrepareOptions, expected: &str| {
        let error = format!("{:#}", prepare(options).unwrap_err());
        assert!(error.contains(expected), "{error}\nexpected: {expected}");
        let left: Vec<_> = (std::fs::read_dir(&dir).unwrap())
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name != "input" && name != "bad")
            .collect();
        assert!(left.is_empty(), "left behind after {expected:?}: {left:?}");
    };
    let bad = dir.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    let invalid = bad.join("latin1.txt");
    std::fs::write(&invalid, b"caf\xe9 au lait").unwrap();
    let mut both = options(&input, &out, TokenizerKind::Char);
    both.inputs.push(invalid.clone());
    refused(
        &both,
        &format!(
            "{} is not UTF-8 text: invalid byte at offset 3",
            invalid.display()
        ),
    );
    let skipping = PrepareOptions {
        skip_invalid: true,
        ..both.clone()
    };
    assert_eq!(prepare(&skipping).unwrap().skipped_documents, 1);
    std::fs::remove_dir_all(&out).unwrap();

    let empty = bad.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let only_empty = PrepareOptions {
        inputs: vec![empty],
        ..options(&input, &out, TokenizerKind::Char)
    };
    refused(&only_empty, "the inputs hold no document for training");

    let reserved = bad.join("reserved.txt");
    std::fs::write(&reserved, "one\u{3}two").unwrap();
    let with_reserved = PrepareOptions {
        inputs: vec![reserved],
        ..options(&input, &out, TokenizerKind::Char)
    };
    refused(&with_reserved, "holds U+0003 at byte 3");

    // 70 000 distinct characters (supplementary planes) do not fit u16 ids.
    let wide = bad.join("wide.txt");
    let chars: String = (0x10000u32..0x10000 + 70_000)
        .filter_map(char::from_u32)
        .collect();
    std::fs::write(&wide, chars).unwrap();
    let too_wide = PrepareOptions {
        inputs: vec![wide],
        dtype: Some(TokenDtype::U16),
        ..options(&input, &out, TokenizerKind::Char)
    };
    refused(&too_wide, "vocabulary of 70001 does not fit U16 tokens");

    let jsonl = bad.join("no-field.jsonl");
    std::fs::write(&jsonl, "{\"body\": \"text\"}\n").unwrap();
    let no_field = PrepareOptions {
        inputs: vec![jsonl],
        ..options(&input, &out, TokenizerKind::Char)
    };
    refused(&no_field, "no-field.jsonl:1 has no string field \"text\"");

    prepare(&options(&input, &out, TokenizerKind::Char)).unwrap();
    let again = format!(
        "{:#}",
        prepare(&options(&input, &out, TokenizerKind::Char)).unwrap_err()
    );
    assert!(again.contains("already exists"), "{again}");
}

#[test]
fn damaged_shards_are_named() {
    let dir = run_dir("prepare-damaged");
    let input = corpus(&dir);
    let out = dir.join("out");
    let manifest = prepare(&options(&input, &out, TokenizerKind::Char)).unwrap();
    let shard = out.join(&manifest.shards[1].file);
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[10] ^= 1;
    std::fs::write(&shard, &bytes).unwrap();
    let error = format!("{:#}", Prepared::open(&out).unwrap_err());
    assert!(
        error.contains(&format!("shard {} has SHA-256", shard.display())),
        "{error}"
    );
    bytes.truncate(bytes.len() - 2);
    std::fs::write(&shard, &bytes).unwrap();
    let error = format!("{:#}", Prepared::open(&out).unwrap_err());
    let expected = format!("shard {} holds {} bytes", shard.display(), bytes.len());
    assert!(error.contains(&expected), "{error}");
    assert_eq!(
        manifest.tokens(Split::Train),
        manifest
            .shards
            .iter()
            .filter(|s| s.split == Split::Train)
            .map(|s| s.tokens)
            .sum::<u64>()
    );
}

/// `wildfire` with `args`; its output, after asserting success when `succeed`.
fn wildfire(args: &[String], succeed: bool) -> String {
    let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), args), LIMIT);
    assert_eq!(
        out.status.success(),
        succeed,
        "wildfire {args:?}:\n{}",
        text(&out)
    );
    text(&out)
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// The training losses recorded in `run`'s metrics.
fn losses(run: &Path) -> Vec<f64> {
    crate::common::series(run, "train", "loss")
}

#[test]
fn training_on_prepared_data_resumes_bitwise_and_refuses_other_data() {
    let dir = run_dir("prepare-train");
    let input = corpus(&dir);
    let data = dir.join("data");
    let data_arg = data.display().to_string();
    let prepare_cli = || {
        let input = input.display().to_string();
        let args = [
            "prepare",
            "--input",
            &input,
            "--out",
            &data_arg,
            "--tokenizer",
            "char",
        ];
        wildfire(&strings(&args), true)
    };
    prepare_cli();
    let run = dir.join("run");
    let train = |extra: &[&str], succeed: bool| {
        let mut args = strings(&["train", "--data", &data_arg]);
        for set in [
            format!("run.dir={}", run.display()),
            "model.context=16".into(),
            "train.micro_batch=4".into(),
            "train.max_steps=6".into(),
            "train.eval_every=3".into(),
            "train.eval_batches=2".into(),
            "checkpoint.every=3".into(),
            "checkpoint.keep_last=0".into(),
            "run.threads=1".into(),
        ] {
            args.push("--set".into());
            args.push(set);
        }
        args.extend(strings(extra));
        wildfire(&args, succeed)
    };
    // Two data-parallel ranks (threads) train on it too.
    let two = format!("run.dir={}", dir.join("dp-2").display());
    train(&["--dp", "2", "--transport", "local", "--set", &two], true);
    assert_eq!(losses(&dir.join("dp-2")).len(), 6);

    train(&[], true);
    let straight = losses(&run);
    assert_eq!(straight.len(), 6);
    crate::common::remove_checkpoints(&run, 6..=6);
    train(&["--resume"], true);
    assert_eq!(losses(&run), straight, "resumed on prepared data");

    // The same path prepared again from one more document is other data.
    std::fs::write(input.join("e.txt"), "One more document.\n").unwrap();
    std::fs::remove_dir_all(&data).unwrap();
    prepare_cli();
    crate::common::remove_checkpoints(&run, 6..=6);
    let refused = train(&["--resume"], false);
    assert!(refused.contains("was prepared differently"), "{refused}");

    // A blend of this data and a second preparation of it (another split: the same characters,
    // as a blend's parts need), 0.7 : 0.3, trains and resumes bitwise.
    let second = dir.join("second");
    let (input_arg, second_arg) = (input.display().to_string(), second.display().to_string());
    let args = [
        "prepare",
        "--input",
        &input_arg,
        "--out",
        &second_arg,
        "--tokenizer",
        "char",
    ];
    wildfire(
        &strings(&[&args[..], &["--seed", "99", "--val-fraction", "0.5"]].concat()),
        true,
    );
    let blended = dir.join("blended");
    let blend_run = |resume: bool| {
        let spec = format!("{data_arg}:0.7,{second_arg}:0.3");
        let mut args = strings(&["train", "--data", &spec]);
        for set in [
            format!("run.dir={}", blended.display()),
            "model.context=16".into(),
            "train.micro_batch=4".into(),
            "train.max_steps=6".into(),
            "train.eval_every=0".into(),
            "checkpoint.every=3".into(),
            "checkpoint.keep_last=0".into(),
            "run.threads=1".into(),
        ] {
            args.extend(["--set".into(), set]);
        }
        if resume {
            args.push("--resume".into());
        }
        wildfire(&args, true)
    };
    blend_run(false);
    let straight = losses(&blended);
    assert_eq!(straight.len(), 6);
    crate::common::remove_checkpoints(&blended, 6..=6);
    blend_run(true);
    assert_eq!(losses(&blended), straight, "resumed on a blend");

    let fresh = format!("run.dir={}", dir.join("fresh").display());
    let other = train(&["--set", &fresh, "--set", "data.tokenizer=gpt2"], false);
    assert!(
        other.contains("prepared with the char tokenizer, but data.tokenizer = gpt2"),
        "{other}"
    );
}
