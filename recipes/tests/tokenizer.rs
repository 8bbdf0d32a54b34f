//! Hugging Face tokenizers from a `tokenizer.json`: text round-trips exactly, the stored form
//! (what checkpoints and prepared manifests keep) rebuilds the same tokenizer, and (an ignored
//! test, for where transformers is installed) the ids are transformers' own.

use wildfire_recipes::data::{Tokenizer, TokenizerKind};

use crate::common::{CORPUS, llama3_style_tokenizer, python_required, run_dir};

/// The bundled corpus followed by what English prose lacks: accents, CJK, an emoji, Windows
/// line ends, tabs, runs of blank lines and trailing spaces.
fn awkward_text() -> String {
    let corpus = std::fs::read_to_string(CORPUS).unwrap();
    format!("{corpus}\r\nnaïve café, 東京 🚀\tand\ttabs\n\n\n  indented   {corpus}    ")
}

#[test]
fn a_tokenizer_json_round_trips_text() {
    let dir = run_dir("hf-tokenizer");
    let path = llama3_style_tokenizer(&dir, 512);
    let tokenizer = Tokenizer::hugging_face(&path).unwrap();
    assert_eq!(tokenizer.kind(), TokenizerKind::Hf);
    assert_eq!(tokenizer.vocab_size(), 512);

    let text = awkward_text();
    let ids = tokenizer.encode(&text).unwrap();
    // 512 ids merge about two bytes per id on this corpus.
    assert!(
        ids.len() * 3 < text.len() * 2,
        "{} ids for {} bytes: the merges apply",
        ids.len(),
        text.len()
    );
    assert!(ids.iter().all(|&id| id < 512));
    assert_eq!(tokenizer.decode(&ids).unwrap(), text, "exact round trip");

    let stored = Tokenizer::stored(TokenizerKind::Hf, &tokenizer.definition()).unwrap();
    assert_eq!(stored.encode(&text).unwrap(), ids, "the stored form");
    assert_eq!(
        tokenizer.decode(&[5, 512]).unwrap_err().to_string(),
        "token id 512 is outside the vocabulary of 512"
    );
}

/// Hugging Face transformers' fast tokenizer, built from the same tokenizer.json, gives our ids
/// of the awkward text and decodes them to the text.
#[test]
#[ignore = "needs python3 with transformers"]
fn a_tokenizer_json_encodes_as_transformers() {
    let dir = run_dir("hf-tokenizer-transformers");
    let path = llama3_style_tokenizer(&dir, 512);
    let text = awkward_text();
    let ids = Tokenizer::hugging_face(&path)
        .unwrap()
        .encode(&text)
        .unwrap();
    let text_file = dir.join("text.txt");
    std::fs::write(&text_file, &text).unwrap();
    let args = [path.to_str().unwrap(), text_file.to_str().unwrap()];
    let check = python_required("check_hf_tokenizer.py", &args);
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert!(check.status.success(), "{stderr}");
    let theirs: serde_json::Value = serde_json::from_slice(&check.stdout).unwrap();
    let their_ids: Vec<u32> = serde_json::from_value(theirs["ids"].clone()).unwrap();
    assert_eq!(their_ids, ids, "transformers' ids");
    assert_eq!(theirs["decoded"].as_str(), Some(text.as_str()));
}

#[test]
fn tokenizer_flags_name_what_they_expect() {
    assert_eq!(
        TokenizerKind::parse_flag("gpt2"),
        Ok((TokenizerKind::Gpt2, None))
    );
    let dir = run_dir("hf-tokenizer-flag");
    std::fs::create_dir_all(&dir).unwrap();
    let flag = format!("hf:{}", dir.display());
    assert_eq!(
        TokenizerKind::parse_flag(&flag),
        Ok((TokenizerKind::Hf, Some(dir.join("tokenizer.json")))),
        "a model directory stands for its tokenizer.json"
    );
    let error = TokenizerKind::parse_flag("bpe").unwrap_err();
    assert!(error.contains("expected char, gpt2 or hf:PATH"), "{error}");
    let missing = dir.join("tokenizer.json");
    let error = Tokenizer::hugging_face(&missing).unwrap_err().to_string();
    assert!(error.contains(&missing.display().to_string()), "{error}");
}
