//! Training data: the corpus on disk, tokenizers, and the sharded, resumable window sampler.

mod corpus;
mod sampler;
mod tokenizer;

pub use corpus::{BUNDLED_CORPUS_PATH, Splits, load_text};
pub use sampler::{Cursor, Sampler, SamplerError, SplitMix64};
pub use tokenizer::{Tokenizer, TokenizerError, TokenizerKind};
