//! GPT-2's byte-level BPE encoder: tiktoken's `r50k_base` ranks (as the tiktoken-rs crate ships
//! them) behind a pre-tokenizer that needs no look-around.
//!
//! GPT-2 first cuts text into pieces with
//!
//! ```text
//! 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//! ```
//!
//! and then merges each piece's bytes by rank. The lookahead in `\s+(?!\S)` needs a
//! backtracking engine (tiktoken-rs runs fancy-regex), and that is most of the cost of
//! encoding. Without the `\s+(?!\S)` alternative the pattern runs on the `regex` crate's
//! automata, with the same leftmost-first choice among alternatives; the lookahead is put
//! back by hand. It only changes a piece that is all whitespace (no other alternative matches
//! whitespace alone): a run of `k ≥ 2` whitespace characters followed by a non-space matches
//! `\s+(?!\S)` with its first `k − 1` characters, leaving the last to start the next piece
//! (as the optional space of ` ?\p{L}+`, or alone); a run at the end of the text, or of one
//! character, is `\s+` whole either way. So the pieces, and the ids, are tiktoken's exactly
//! (tested against tiktoken-rs).

use regex::Regex;
use rustc_hash::FxHashMap;
use tiktoken_rs::CoreBPE;

/// GPT-2's vocabulary size (50,000 merges, 256 bytes, `<|endoftext|>`).
pub const GPT2_VOCAB: usize = 50257;
/// GPT-2's `<|endoftext|>`.
pub const GPT2_END_OF_TEXT: u32 = 50256;

/// GPT-2's pre-tokenisation pattern without the `\s+(?!\S)` alternative (see the module doc).
const PIECES: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// GPT-2's tokenizer: tiktoken-rs's for decoding, and the encoder of this module.
pub struct Gpt2Bpe {
    tiktoken: CoreBPE,
    /// Every mergeable token's bytes, to its id.
    ranks: FxHashMap<Vec<u8>, u32>,
    pieces: Regex,
}

impl std::fmt::Debug for Gpt2Bpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpt2Bpe({} ranks)", self.ranks.len())
    }
}

impl Gpt2Bpe {
    /// `r50k_base`: its mergeable ranks are ids below `<|endoftext|>` (50256), which text never
    /// produces.
    pub fn load() -> Result<Self, String> {
        let tiktoken = tiktoken_rs::r50k_base().map_err(|e| e.to_string())?;
        let ranks = (0..GPT2_END_OF_TEXT)
            .map(|id| {
                (
                    tiktoken
                        ._decode_native_and_split(vec![id])
                        .flatten()
                        .collect(),
                    id,
                )
            })
            .collect();
        let pieces = Regex::new(PIECES).map_err(|e| e.to_string())?;
        Ok(Self {
            tiktoken,
            ranks,
            pieces,
        })
    }

    /// The bytes of `ids`, which must be GPT-2 ids (below 50257).
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        self.tiktoken
            ._decode_native_and_split(ids.to_vec())
            .flatten()
            .collect()
    }

    /// The ids of `text`, as tiktoken's `encode_ordinary` gives them.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() / 3);
        let mut at = 0;
        while let Some(found) = self.pieces.find_at(text, at) {
            let piece = &text[found.start()..self.piece_end(text, found.start(), found.end())];
            at = found.start() + piece.len();
            let bytes = piece.as_bytes();
            match self.ranks.get(bytes) {
                Some(&id) => ids.push(id),
                None => ids.extend(
                    tiktoken_rs::byte_pair_split(bytes, &self.ranks)
                        .into_iter()
                        .map(|part| self.ranks[part]),
                ),
            }
        }
        ids
    }

    /// Where the piece matched at `start..end` ends under the original pattern: a whitespace
    /// run of two or more characters followed by a non-space gives its last character back.
    fn piece_end(&self, text: &str, start: usize, end: usize) -> usize {
        let run = &text[start..end];
        let followed_by_text = text[end..]
            .chars()
            .next()
            .is_some_and(|c| !c.is_whitespace());
        if !followed_by_text || !run.chars().all(char::is_whitespace) {
            return end;
        }
        let mut chars = run.char_indices().rev();
        match (chars.next(), chars.next()) {
            (Some((last, _)), Some(_)) => start + last,
            _ => end,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_tiktokens_on_whitespace_contractions_and_unicode() {
        let bpe = tiktoken_rs::r50k_base().unwrap();
        let encoder = Gpt2Bpe::load().unwrap();
        let texts = [
            "Hello world",
            "  two  spaces,\tthen a tab\n\nand\r\n lines \n",
            "they're here, we've got 'em; I'd say it's 42 o'clock's worth...",
            "ends with spaces   ",
            "   \n\t  x",
            "naïve café — 東京 🙂 ½ Ⅻ x²",
            "''s !'s  'll\u{a0}\u{2003}nbsp",
            "",
            " ",
            "a\u{3000}\u{3000}b",
        ];
        for text in texts {
            assert_eq!(encoder.encode(text), bpe.encode_ordinary(text), "{text:?}");
        }
        let corpus = include_str!("../../data/shakespeare.txt");
        assert_eq!(
            encoder.encode(corpus),
            bpe.encode_ordinary(corpus),
            "the bundled corpus"
        );
    }
}
