//! Tokenizers: character-level (the vocabulary is the corpus's distinct characters, in code-point
//! order), GPT-2's byte-level BPE (tiktoken's `r50k_base`, whose ranks ship inside the
//! tiktoken-rs crate, so nothing is downloaded; encoded by [`super::gpt2`]), and any Hugging Face
//! `tokenizer.json` ([`super::hf_tokenizer`]).
//!
//! A run stores what rebuilds its tokenizer ([`Tokenizer::definition`]) in its checkpoints and
//! prepared manifests: the characters, nothing for GPT-2 (its tables ship in the binary), or the
//! `tokenizer.json` text.

use std::path::{Path, PathBuf};

use super::gpt2::{GPT2_VOCAB, Gpt2Bpe};
use super::hf_tokenizer::HfTokenizer;
use super::tokenizer_error::TokenizerError;
use serde::{Deserialize, Serialize};

/// Which tokenizer a run uses; stored in the run's config and checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TokenizerKind {
    Char,
    Gpt2,
    /// A Hugging Face `tokenizer.json`.
    Hf,
}

impl TokenizerKind {
    /// A command-line choice: `char`, `gpt2` or `hf:PATH` (a `tokenizer.json`, or a model
    /// directory holding one).
    pub fn parse_flag(flag: &str) -> Result<(Self, Option<PathBuf>), String> {
        match flag {
            "char" => Ok((Self::Char, None)),
            "gpt2" => Ok((Self::Gpt2, None)),
            _ => match flag.strip_prefix("hf:") {
                Some(path) if !path.is_empty() => Ok((Self::Hf, Some(tokenizer_json(path)))),
                _ => Err(format!(
                    "tokenizer {flag:?}: expected char, gpt2 or hf:PATH (a tokenizer.json or a \
                     model directory holding one)"
                )),
            },
        }
    }
}

/// `path` itself, or `path/tokenizer.json` when `path` is a directory.
pub fn tokenizer_json(path: impl AsRef<Path>) -> PathBuf {
    let path = path.as_ref();
    match path.is_dir() {
        true => path.join("tokenizer.json"),
        false => path.to_path_buf(),
    }
}

impl std::fmt::Display for TokenizerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Char => "char",
            Self::Gpt2 => "gpt2",
            Self::Hf => "hf",
        })
    }
}

/// A tokenizer ready to encode and decode.
pub enum Tokenizer {
    /// `chars[id]` is the character of token `id`.
    Char {
        chars: Vec<char>,
    },
    Gpt2(Box<Gpt2Bpe>),
    Hf(Box<HfTokenizer>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Char { chars } => write!(f, "Tokenizer::Char({} chars)", chars.len()),
            Self::Gpt2(_) => write!(f, "Tokenizer::Gpt2"),
            Self::Hf(hf) => write!(f, "Tokenizer::{hf:?}"),
        }
    }
}

impl Tokenizer {
    /// A character tokenizer over the distinct characters of `text`.
    pub fn char_level(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        Self::Char { chars }
    }

    /// A character tokenizer with a given vocabulary (as saved in a checkpoint).
    pub fn from_chars(vocab: &str) -> Self {
        Self::Char {
            chars: vocab.chars().collect(),
        }
    }

    pub fn gpt2() -> Result<Self, TokenizerError> {
        Gpt2Bpe::load()
            .map(|bpe| Self::Gpt2(Box::new(bpe)))
            .map_err(TokenizerError::Bpe)
    }

    /// The Hugging Face tokenizer in the `tokenizer.json` at `path`.
    pub fn hugging_face(path: &Path) -> Result<Self, TokenizerError> {
        HfTokenizer::open(path).map(|hf| Self::Hf(Box::new(hf)))
    }

    /// The tokenizer of `kind` that `definition` (a checkpoint's or manifest's, see
    /// [`Tokenizer::definition`]) describes.
    pub fn stored(kind: TokenizerKind, definition: &str) -> Result<Self, TokenizerError> {
        match kind {
            TokenizerKind::Char => Ok(Self::from_chars(definition)),
            TokenizerKind::Gpt2 => Self::gpt2(),
            TokenizerKind::Hf => HfTokenizer::from_json(definition.to_string(), "stored")
                .map(|hf| Self::Hf(Box::new(hf))),
        }
    }

    pub fn kind(&self) -> TokenizerKind {
        match self {
            Self::Char { .. } => TokenizerKind::Char,
            Self::Gpt2(_) => TokenizerKind::Gpt2,
            Self::Hf(_) => TokenizerKind::Hf,
        }
    }

    /// What rebuilds this tokenizer with [`Tokenizer::stored`]: the characters as one string,
    /// nothing for GPT-2 (its tables are fixed), or the `tokenizer.json` text.
    pub fn definition(&self) -> String {
        match self {
            Self::Char { chars } => chars.iter().collect(),
            Self::Gpt2(_) => String::new(),
            Self::Hf(hf) => hf.json().to_string(),
        }
    }

    /// The `tokenizer.json` text of a Hugging Face tokenizer.
    pub fn hf_json(&self) -> Option<&str> {
        match self {
            Self::Hf(hf) => Some(hf.json()),
            _ => None,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Char { chars } => chars.len(),
            Self::Gpt2(_) => GPT2_VOCAB,
            Self::Hf(hf) => hf.vocab_size(),
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match self {
            Self::Char { chars } => text
                .chars()
                .map(|ch| {
                    chars.binary_search(&ch).map(|id| id as u32).map_err(|_| {
                        TokenizerError::UnknownChar {
                            ch,
                            code: ch as u32,
                            size: chars.len(),
                        }
                    })
                })
                .collect(),
            Self::Gpt2(bpe) => Ok(bpe.encode(text)),
            Self::Hf(hf) => hf.encode(text),
        }
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        match self {
            Self::Char { chars } => ids
                .iter()
                .map(|&id| {
                    chars
                        .get(id as usize)
                        .copied()
                        .ok_or(TokenizerError::UnknownId {
                            id,
                            size: chars.len(),
                        })
                })
                .collect(),
            // Sampled BPE tokens may split a multi-byte character: decode lossily.
            Self::Gpt2(bpe) => {
                if let Some(&id) = ids.iter().find(|&&id| id as usize >= GPT2_VOCAB) {
                    return Err(TokenizerError::UnknownId {
                        id,
                        size: GPT2_VOCAB,
                    });
                }
                Ok(String::from_utf8_lossy(&bpe.decode_bytes(ids)).into_owned())
            }
            Self::Hf(hf) => hf.decode(ids),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn char_level_round_trips_and_names_unknown_characters() {
        let tok = Tokenizer::char_level("hello world");
        assert_eq!(tok.vocab_size(), 8);
        let ids = tok.encode("low");
        assert_eq!(tok.decode(&ids.unwrap()).unwrap(), "low");
        let err = tok.encode("hex").unwrap_err().to_string();
        assert_eq!(
            err,
            "character 'x' (U+0078) is not in the 8-character vocabulary"
        );
    }

    #[test]
    fn gpt2_bpe_loads_offline_and_round_trips() {
        let tok = Tokenizer::gpt2().unwrap();
        let ids = tok.encode("Hello world").unwrap();
        assert_eq!(ids, vec![15496, 995], "GPT-2's ids for 'Hello world'");
        assert_eq!(tok.decode(&ids).unwrap(), "Hello world");
    }
}
