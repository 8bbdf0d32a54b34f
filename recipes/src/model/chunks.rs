//! The part of a GPT that one pipeline rank trains: its chunks (virtual stages), each a
//! contiguous run of blocks, with the embedding on stage 0 and the head on the last stage.

use std::ops::Range;

use burn::module::{Module, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use wildfire_backend::DecoratedBackend;
use wildfire_parallel::pp::TiedCopies;

use super::params::{ParamFn, for_each_param};
use super::{Gpt, StageSpec};

/// Rank `rank`'s chunks of a pipeline: chunk `c` is global stage `c·pp + rank`. Without a
/// pipeline it holds one chunk, the whole model.
#[derive(Module, Debug)]
pub struct GptChunks<B: Backend> {
    pub chunks: Vec<Gpt<B>>,
}

/// The stage specs of a model whose blocks are cut into `ranges` (one per stage, in order).
pub fn stage_specs(ranges: &[Range<usize>]) -> Vec<StageSpec> {
    let last = ranges.len().saturating_sub(1);
    ranges
        .iter()
        .enumerate()
        .map(|(stage, blocks)| StageSpec {
            first_block: blocks.start,
            n_blocks: blocks.len(),
            embedding: stage == 0,
            head: stage == last,
        })
        .collect()
}

impl<B: Backend> GptChunks<B> {
    /// Rank `rank`'s chunks when the whole `model` is cut into the stages `ranges` over `pp`
    /// ranks. With one stage, the whole model.
    pub fn for_rank(model: Gpt<B>, ranges: &[Range<usize>], pp: usize, rank: usize) -> Self {
        let chunks = model
            .split(&stage_specs(ranges))
            .into_iter()
            .enumerate()
            .filter(|(stage, _)| stage % pp == rank)
            .map(|(_, chunk)| chunk)
            .collect();
        Self { chunks }
    }

    /// Logits of token ids, through the chunks in order: for a rank that holds every stage.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3>
    where
        B: DecoratedBackend,
    {
        self.last().logits(self.residual(tokens))
    }

    /// The summed next-token loss of the whole model on `tokens` against `targets` (see
    /// [`Gpt::head_loss_sum`]).
    pub fn loss_sum(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1>
    where
        B: DecoratedBackend,
    {
        self.last().head_loss_sum(self.residual(tokens), targets)
    }

    /// The residual stream after the last block.
    fn residual(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3>
    where
        B: DecoratedBackend,
    {
        let x = self.chunks[0].embed(tokens);
        self.chunks.iter().fold(x, |x, chunk| chunk.run_blocks(x))
    }

    /// The last chunk (the one with the head, on a rank that holds every stage).
    pub fn last(&self) -> &Gpt<B> {
        &self.chunks[self.chunks.len() - 1]
    }

    /// Calls `f` on every float parameter with its global name (chunks in order).
    pub fn for_each_param<F: ParamFn<B>>(&self, f: &mut F) {
        for chunk in &self.chunks {
            for_each_param(chunk, chunk.first_block, f);
        }
    }

    /// The ids and ranks (dimensions) of the parameters whose global name and rank satisfy
    /// `keep`, in module order.
    pub fn param_ids_where(&self, keep: impl FnMut(&str, usize) -> bool) -> Vec<(ParamId, usize)> {
        struct Select<K> {
            keep: K,
            ids: Vec<(ParamId, usize)>,
        }
        impl<B: Backend, K: FnMut(&str, usize) -> bool> ParamFn<B> for Select<K> {
            fn visit<const D: usize>(&mut self, name: &str, param: &Param<Tensor<B, D>>) {
                if (self.keep)(name, D) {
                    self.ids.push((param.id, D));
                }
            }
        }
        let mut select = Select {
            keep,
            ids: Vec::new(),
        };
        self.for_each_param(&mut select);
        select.ids
    }

    /// The token embedding and the head's tied copy of it, where this rank holds them (see
    /// [`super::Head::wte`]).
    pub fn tied_embedding(&self) -> TiedCopies {
        let first = self
            .chunks
            .iter()
            .find_map(|c| c.embeddings.as_ref().map(|e| e.wte.weight.id));
        let second = self
            .chunks
            .iter()
            .find_map(|c| c.head.as_ref().and_then(|h| h.wte.as_ref().map(|w| w.id)));
        TiedCopies { first, second }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;

    use super::super::params::collect_params;
    use super::super::{GptConfig, Preset, TIED_COPY};
    use super::*;

    /// Every stage's parameters are the serial model's, bitwise, and each appears on exactly
    /// one rank (the tied copy aside, which equals the token embedding).
    #[test]
    fn stages_are_bitwise_parts_of_the_serial_model() {
        let config = GptConfig {
            n_layer: 5,
            ..Preset::Tiny.config(40)
        };
        let device = Default::default();
        // One model, cloned (parameters are drawn at construction): other tests reseed the
        // shared RNG concurrently, so drawing twice would not be a fair comparison.
        let whole = Gpt::<Flex>::new(&config, StageSpec::whole(&config), &device);
        let build = || whole.clone();
        let serial: std::collections::BTreeMap<String, Vec<f32>> = collect_params(&build(), 0)
            .into_iter()
            .map(|(name, _, data)| (name, data.to_vec().unwrap()))
            .collect();
        let ranges = [0..2, 2..3, 3..4, 4..5];
        let mut seen = std::collections::BTreeMap::new();
        for rank in 0..2 {
            let chunks = GptChunks::for_rank(build(), &ranges, 2, rank);
            assert_eq!(chunks.chunks.len(), 2);
            for chunk in &chunks.chunks {
                for (name, _, data) in collect_params(chunk, chunk.first_block) {
                    let values: Vec<f32> = data.to_vec().unwrap();
                    let expected = if name == TIED_COPY {
                        &serial["embeddings.wte.weight"]
                    } else {
                        &serial[&name]
                    };
                    assert_eq!(&values, expected, "{name} on rank {rank}");
                    assert!(seen.insert(name.clone(), rank).is_none(), "{name} twice");
                }
            }
        }
        assert_eq!(
            seen.len(),
            serial.len() + 1,
            "every parameter, plus the tied copy"
        );
        assert_eq!(seen[TIED_COPY], 1, "the head is on the last stage (rank 1)");
    }
}
