//! What encoding, decoding or loading a tokenizer can fail with, for every tokenizer kind.

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("character {ch:?} (U+{code:04X}) is not in the {size}-character vocabulary")]
    UnknownChar { ch: char, code: u32, size: usize },
    #[error("token id {id} is outside the vocabulary of {size}")]
    UnknownId { id: u32, size: usize },
    #[error("GPT-2 BPE tables failed to load: {0}")]
    Bpe(String),
    #[error("Hugging Face tokenizer {origin}: {reason}")]
    HuggingFace { origin: String, reason: String },
}
