//! Deterministic, resumable, data-parallel sampling of (input, target) windows.
//!
//! The token stream is cut into non-overlapping windows of `context + 1` tokens, window `i`
//! starting at token `i · context` (its last token is the next window's first, so every token is
//! a target exactly once per epoch). Each epoch visits the windows in a permutation drawn from
//! `(seed, epoch)`; consecutive runs of `global_batch` windows form the optimizer steps, and an
//! incomplete last batch is dropped, as DistributedSampler with `drop_last` does.
//!
//! With data parallelism, rank `r` of `dp` takes the `r`-th contiguous `global_batch / dp`
//! windows of every global batch, so the ranks' parts are disjoint and together form exactly the
//! batch a single device would see. That is what lets a parallel run be compared with a serial
//! one. The [`Cursor`] (epoch, batch) is all the state there is: saving it resumes the stream.

use serde::{Deserialize, Serialize};

/// Position of the next global batch: epoch number and batch index inside it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    pub epoch: u64,
    pub batch: u64,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplerError {
    #[error(
        "global batch {global_batch} does not split over {dp} data-parallel ranks \
         (global_batch % dp = {})", global_batch % dp
    )]
    Uneven { global_batch: usize, dp: usize },
    #[error(
        "{tokens} tokens give {windows} windows of context {context} + 1, fewer than one global \
         batch of {global_batch}"
    )]
    TooFewWindows {
        tokens: usize,
        windows: usize,
        context: usize,
        global_batch: usize,
    },
    #[error("data-parallel rank {rank} is outside 0..{dp}")]
    Rank { rank: usize, dp: usize },
}

/// Sampler of one data-parallel rank.
#[derive(Debug, Clone)]
pub struct Sampler {
    n_windows: usize,
    context: usize,
    global_batch: usize,
    seed: u64,
    dp_rank: usize,
    dp: usize,
    cursor: Cursor,
    /// The current epoch's permutation, `(epoch, order)`.
    order: Option<(u64, Vec<u32>)>,
}

impl Sampler {
    pub fn new(
        n_tokens: usize,
        context: usize,
        global_batch: usize,
        seed: u64,
        (dp_rank, dp): (usize, usize),
    ) -> Result<Self, SamplerError> {
        if dp_rank >= dp {
            return Err(SamplerError::Rank { rank: dp_rank, dp });
        }
        if global_batch == 0 || !global_batch.is_multiple_of(dp) {
            return Err(SamplerError::Uneven { global_batch, dp });
        }
        let n_windows = n_tokens.saturating_sub(1) / context;
        if n_windows < global_batch {
            return Err(SamplerError::TooFewWindows {
                tokens: n_tokens,
                windows: n_windows,
                context,
                global_batch,
            });
        }
        Ok(Self {
            n_windows,
            context,
            global_batch,
            seed,
            dp_rank,
            dp,
            cursor: Cursor::default(),
            order: None,
        })
    }

    pub fn batches_per_epoch(&self) -> u64 {
        (self.n_windows / self.global_batch) as u64
    }

    pub fn cursor(&self) -> Cursor {
        self.cursor
    }

    /// Continue from a saved position.
    pub fn seek(&mut self, cursor: Cursor) {
        self.cursor = cursor;
    }

    /// Start offsets (in tokens) of this rank's windows for the next global batch.
    pub fn next_batch(&mut self) -> Vec<usize> {
        if self.cursor.batch >= self.batches_per_epoch() {
            self.cursor = Cursor {
                epoch: self.cursor.epoch + 1,
                batch: 0,
            };
        }
        let epoch = self.cursor.epoch;
        if self.order.as_ref().is_none_or(|(e, _)| *e != epoch) {
            self.order = Some((epoch, self.permutation(epoch)));
        }
        let order = &self.order.as_ref().expect("permutation computed above").1;
        let local = self.global_batch / self.dp;
        let start = self.cursor.batch as usize * self.global_batch + self.dp_rank * local;
        self.cursor.batch += 1;
        order[start..start + local]
            .iter()
            .map(|&w| w as usize * self.context)
            .collect()
    }

    /// Fisher–Yates shuffle of the window indices, seeded by `(seed, epoch)`.
    fn permutation(&self, epoch: u64) -> Vec<u32> {
        let mut rng = SplitMix64::new(self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut order: Vec<u32> = (0..self.n_windows as u32).collect();
        for i in (1..order.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            order.swap(i, j);
        }
        order
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny generator whose output depends only on its seed,
/// so shuffles stay identical across crate versions and platforms.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (Lemire's multiply-shift; the bias is below 2⁻³² for n < 2³²).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_split_every_global_batch_disjointly() {
        let tokens = 64 * 8 + 1;
        let mut serial = Sampler::new(tokens, 8, 16, 7, (0, 1)).unwrap();
        let mut ranks: Vec<_> = (0..4)
            .map(|r| Sampler::new(tokens, 8, 16, 7, (r, 4)).unwrap())
            .collect();
        for _ in 0..10 {
            let whole = serial.next_batch();
            let parts: Vec<usize> = ranks.iter_mut().flat_map(|s| s.next_batch()).collect();
            assert_eq!(parts, whole);
            let mut unique = whole.clone();
            unique.sort();
            unique.dedup();
            assert_eq!(unique.len(), 16);
        }
    }

    #[test]
    fn epochs_reshuffle_and_cover_each_window_once() {
        let mut sampler = Sampler::new(33 * 4 + 1, 4, 11, 1, (0, 1)).unwrap();
        assert_eq!(sampler.batches_per_epoch(), 3);
        let epoch0: Vec<usize> = (0..3).flat_map(|_| sampler.next_batch()).collect();
        let epoch1: Vec<usize> = (0..3).flat_map(|_| sampler.next_batch()).collect();
        assert_ne!(epoch0, epoch1);
        for epoch in [epoch0, epoch1] {
            let mut sorted = epoch.clone();
            sorted.sort();
            sorted.dedup();
            assert_eq!(
                sorted.len(),
                33,
                "33 windows, none repeated within an epoch"
            );
        }
        assert_eq!(sampler.cursor(), Cursor { epoch: 1, batch: 3 });
    }

    #[test]
    fn seeking_resumes_the_same_stream() {
        let mut a = Sampler::new(1000, 4, 8, 3, (0, 1)).unwrap();
        for _ in 0..40 {
            a.next_batch();
        }
        let mut b = Sampler::new(1000, 4, 8, 3, (0, 1)).unwrap();
        b.seek(a.cursor());
        for _ in 0..50 {
            assert_eq!(a.next_batch(), b.next_batch());
        }
    }

    #[test]
    fn bad_shapes_name_their_numbers() {
        let err = Sampler::new(1000, 4, 10, 0, (0, 4)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "global batch 10 does not split over 4 data-parallel ranks (global_batch % dp = 2)"
        );
        let err = Sampler::new(20, 4, 8, 0, (0, 1)).unwrap_err();
        assert!(
            err.to_string().contains("20 tokens give 4 windows"),
            "{err}"
        );
    }
}
