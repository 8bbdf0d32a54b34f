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
//!
//! **Blends** ([`Sampler::blended`]) draw from several datasets with weights `w_d` (summing to
//! 1), as Megatron's blended datasets do: sample `i` of the stream comes from the dataset whose
//! share is furthest behind, `d_i = argmax_d (w_d·(i + 1) − n_d)` with `n_d` the samples it gave
//! so far (ties to the first), so every prefix of the stream holds each dataset within one
//! sample of its share. Dataset `d`'s `j`-th sample is window `π_{d,e}(j mod W_d)` of its own
//! epoch `e = ⌊j / W_d⌋`, a permutation seeded by `(seed, d, e)`. Global batches are runs of
//! the stream; ranks take their parts as above; the cursor's `batch` counts global batches.

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
    #[error("a blend weight must be a positive number, not {weight}")]
    Weight { weight: f64 },
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
    /// The datasets of a blend (none: one dataset, read by epochs as above).
    blend: Option<Blend>,
}

/// The datasets of a blended stream and how far it has drawn from each.
#[derive(Debug, Clone)]
struct Blend {
    parts: Vec<BlendPart>,
    /// Samples of the stream drawn so far.
    drawn: u64,
}

#[derive(Debug, Clone)]
struct BlendPart {
    /// Where the dataset's tokens start in the blended token stream.
    base: usize,
    windows: usize,
    weight: f64,
    /// Samples this dataset gave so far.
    given: u64,
    /// The permutation of its current epoch, `(epoch, order)`.
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
            blend: None,
        })
    }

    /// A sampler of a blend of datasets, each `(tokens, base, weight)`: its number of tokens,
    /// where they start in the blended token stream, and its share of the samples (the weights
    /// are normalised to sum to 1). See the module doc.
    pub fn blended(
        datasets: &[(usize, usize, f64)],
        context: usize,
        global_batch: usize,
        seed: u64,
        (dp_rank, dp): (usize, usize),
    ) -> Result<Self, SamplerError> {
        let total: f64 = datasets.iter().map(|&(_, _, w)| w).sum();
        let mut parts = Vec::new();
        for &(tokens, base, weight) in datasets {
            if !(weight > 0.0 && weight.is_finite()) {
                return Err(SamplerError::Weight { weight });
            }
            // Each dataset must hold one global batch of windows, as a lone dataset must.
            let one = Self::new(tokens, context, global_batch, seed, (dp_rank, dp))?;
            parts.push(BlendPart {
                base,
                windows: one.n_windows,
                weight: weight / total,
                given: 0,
                order: None,
            });
        }
        let n_windows = parts.iter().map(|p| p.windows).sum();
        Ok(Self {
            n_windows,
            blend: Some(Blend { parts, drawn: 0 }),
            ..Self::new(
                n_windows * context + 1,
                context,
                global_batch,
                seed,
                (dp_rank, dp),
            )?
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
        let batches = cursor.epoch * self.batches_per_epoch() + cursor.batch;
        let global_batch = self.global_batch as u64;
        if let Some(blend) = &mut self.blend {
            // Replays the draws before the cursor (cheap: no windows are read).
            blend.rewind();
            for _ in 0..batches * global_batch {
                blend.draw();
            }
            self.cursor = Cursor {
                epoch: 0,
                batch: batches,
            };
        }
    }

    /// Start offsets (in tokens) of this rank's windows for the next global batch.
    pub fn next_batch(&mut self) -> Vec<usize> {
        if let Some(blend) = &mut self.blend {
            let local = self.global_batch / self.dp;
            let mine = self.dp_rank * local..(self.dp_rank + 1) * local;
            self.cursor.batch += 1;
            return (0..self.global_batch)
                .filter_map(|i| blend.next_window(self.seed, self.context, mine.contains(&i)))
                .collect();
        }
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
        shuffled(
            self.n_windows,
            self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        )
    }
}

/// `0..n` in a Fisher–Yates order drawn from `seed`.
fn shuffled(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = SplitMix64::new(seed);
    let mut order: Vec<u32> = (0..n as u32).collect();
    for i in (1..order.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

impl Blend {
    fn rewind(&mut self) {
        self.drawn = 0;
        for part in &mut self.parts {
            part.given = 0;
        }
    }

    /// The dataset of the next sample, counted as drawn.
    fn draw(&mut self) -> usize {
        let i = self.drawn as f64;
        let behind = |p: &BlendPart| p.weight * (i + 1.0) - p.given as f64;
        let mut chosen = 0;
        for (d, part) in self.parts.iter().enumerate() {
            if behind(part) > behind(&self.parts[chosen]) {
                chosen = d;
            }
        }
        self.drawn += 1;
        self.parts[chosen].given += 1;
        chosen
    }

    /// Draws the next sample; its window's start in the blended token stream when `read`.
    fn next_window(&mut self, seed: u64, context: usize, read: bool) -> Option<usize> {
        let d = self.draw();
        if !read {
            return None;
        }
        let part = &mut self.parts[d];
        let j = part.given - 1;
        let epoch = j / part.windows as u64;
        if part.order.as_ref().is_none_or(|(e, _)| *e != epoch) {
            let seed = seed ^ (d as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
            let order = shuffled(
                part.windows,
                seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            part.order = Some((epoch, order));
        }
        let order = &part.order.as_ref().expect("computed above").1;
        Some(part.base + order[(j % part.windows as u64) as usize] as usize * context)
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

    /// An epoch drawn by 2 ranks up to a cursor and by 4 ranks from it (or the other way
    /// round) is the epoch 1 rank draws: each window once, and the same global batches.
    #[test]
    fn a_resume_at_another_dp_continues_the_epoch() {
        let (tokens, context, global) = (48 * 4 + 1, 4, 8);
        let ranks = |dp: usize| -> Vec<Sampler> {
            (0..dp)
                .map(|r| Sampler::new(tokens, context, global, 5, (r, dp)).unwrap())
                .collect()
        };
        let global_batch = |ranks: &mut [Sampler]| -> Vec<usize> {
            ranks.iter_mut().flat_map(|s| s.next_batch()).collect()
        };
        let mut serial = ranks(1);
        let epoch: Vec<Vec<usize>> = (0..6).map(|_| global_batch(&mut serial)).collect();
        for (before, after) in [(2, 4), (4, 2)] {
            let mut first = ranks(before);
            let mut drawn: Vec<Vec<usize>> = (0..2).map(|_| global_batch(&mut first)).collect();
            let mut second = ranks(after);
            for sampler in &mut second {
                sampler.seek(first[0].cursor());
            }
            drawn.extend((2..6).map(|_| global_batch(&mut second)));
            assert_eq!(drawn, epoch, "dp {before} then dp {after}");
            let mut windows: Vec<usize> = drawn.concat();
            windows.sort();
            windows.dedup();
            assert_eq!(windows.len(), 48, "each window of the epoch once");
        }
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

    /// Two datasets of 41 and 13 windows of 4 tokens, the second starting at token 1000.
    fn blend(weights: [f64; 2], rank: (usize, usize)) -> Sampler {
        let parts = [(41 * 4 + 1, 0, weights[0]), (13 * 4 + 1, 1000, weights[1])];
        Sampler::blended(&parts, 4, 10, 3, rank).unwrap()
    }

    #[test]
    fn a_blend_keeps_every_prefix_within_one_sample_of_its_shares() {
        let mut sampler = blend([7.0, 3.0], (0, 1));
        let (mut first, mut second) = (Vec::new(), Vec::new());
        for batch in 1..=30 {
            for start in sampler.next_batch() {
                match start < 1000 {
                    true => first.push(start),
                    false => second.push(start - 1000),
                }
            }
            let drawn = 10.0 * batch as f64;
            assert!(
                (first.len() as f64 - 0.7 * drawn).abs() <= 1.0,
                "batch {batch}"
            );
            assert!(
                (second.len() as f64 - 0.3 * drawn).abs() <= 1.0,
                "batch {batch}"
            );
        }
        // Each dataset's epochs visit each of its windows once (90 samples: 6 epochs of 13).
        for epoch in second.chunks_exact(13) {
            let mut windows: Vec<usize> = epoch.iter().map(|s| s / 4).collect();
            windows.sort();
            assert_eq!(windows, (0..13).collect::<Vec<_>>());
        }
        assert!(first.iter().all(|s| s % 4 == 0 && s / 4 < 41));
    }

    #[test]
    fn a_blend_splits_over_ranks_and_resumes() {
        let mut serial = blend([0.5, 0.5], (0, 1));
        let mut ranks = [blend([0.5, 0.5], (0, 2)), blend([0.5, 0.5], (1, 2))];
        for _ in 0..12 {
            let whole = serial.next_batch();
            let parts: Vec<usize> = ranks.iter_mut().flat_map(|s| s.next_batch()).collect();
            assert_eq!(parts, whole);
        }
        let mut resumed = blend([0.5, 0.5], (0, 1));
        resumed.seek(serial.cursor());
        for _ in 0..20 {
            assert_eq!(resumed.next_batch(), serial.next_batch());
        }
        let error = Sampler::blended(&[(100, 0, 0.0)], 4, 10, 3, (0, 1)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "a blend weight must be a positive number, not 0"
        );
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
