//! Training data: the corpus on disk, tokenizers, prepared token shards (`wildfire prepare`)
//! read through memory maps, and the sharded, resumable window sampler.

mod corpus;
mod gpt2;
mod hf_tokenizer;
mod prepare;
mod prepared;
mod sampler;
mod tokenizer;
mod tokenizer_error;

pub use corpus::{BUNDLED_CORPUS_PATH, Splits, load_text};
pub use gpt2::{GPT2_END_OF_TEXT, GPT2_VOCAB};
pub use hf_tokenizer::{END_OF_TEXT_NAMES, HfTokenizer};
pub use prepare::{CHAR_END_OF_TEXT, PrepareOptions, prepare};
pub use prepared::{
    Blend, DocumentCounts, MANIFEST, Manifest, Prepared, ShardEntry, Split, TokenDtype, Tokens,
    is_prepared,
};
pub use sampler::{Cursor, Sampler, SamplerError, SplitMix64};
pub use tokenizer::{Tokenizer, TokenizerKind, tokenizer_json};
pub use tokenizer_error::TokenizerError;
