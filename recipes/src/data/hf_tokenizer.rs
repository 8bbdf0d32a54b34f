//! A Hugging Face `tokenizer.json` (Llama 3's, GPT-2's, or one trained with the `tokenizers`
//! library), run by Hugging Face's own `tokenizers` crate: the ids are those of
//! `transformers`' fast tokenizer with `add_special_tokens=False`, and decoding gives the text
//! back exactly for byte-level models. The file's text travels with the runs that use it (in
//! checkpoints and prepared manifests), so a run never depends on the file staying where it was.

use std::path::Path;

use super::tokenizer_error::TokenizerError;

/// End-of-document tokens by the names the common families give them (Llama 3, GPT-2,
/// Llama 2 and Mistral, Gemma): the first one the vocabulary holds separates the documents of
/// prepared data.
pub const END_OF_TEXT_NAMES: [&str; 4] = ["<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"];

/// A `tokenizer.json` loaded, with its text.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    json: String,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HfTokenizer({} ids)", self.vocab_size())
    }
}

impl HfTokenizer {
    /// Reads the `tokenizer.json` at `path`.
    pub fn open(path: &Path) -> Result<Self, TokenizerError> {
        let json = std::fs::read_to_string(path).map_err(|e| TokenizerError::HuggingFace {
            origin: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Self::from_json(json, &path.display().to_string())
    }

    /// The tokenizer a `tokenizer.json` text defines; `origin` names it in errors.
    pub fn from_json(json: String, origin: &str) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_bytes(json.as_bytes()).map_err(|e| {
            TokenizerError::HuggingFace {
                origin: origin.to_string(),
                reason: e.to_string(),
            }
        })?;
        Ok(Self { inner, json })
    }

    /// The file's text, as checkpoints and prepared manifests keep it.
    pub fn json(&self) -> &str {
        &self.json
    }

    /// Every id the tokenizer can produce or decode, its added (special) tokens included: 128,256
    /// for Llama 3.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of the first of [`END_OF_TEXT_NAMES`] the vocabulary holds.
    pub fn end_of_text(&self) -> Option<u32> {
        END_OF_TEXT_NAMES
            .iter()
            .find_map(|name| self.inner.token_to_id(name))
    }

    /// The ids of `text`, with no special tokens added (no beginning-of-text id).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| self.failed(e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens written out; an id outside the vocabulary is an error
    /// (the library would skip it silently).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let size = self.vocab_size();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= size) {
            return Err(TokenizerError::UnknownId { id, size });
        }
        self.inner.decode(ids, false).map_err(|e| self.failed(e))
    }

    fn failed(&self, error: tokenizers::Error) -> TokenizerError {
        TokenizerError::HuggingFace {
            origin: "tokenizer.json".to_string(),
            reason: error.to_string(),
        }
    }
}
