//! Rotary position embeddings (RoPE), as Llama applies them to queries and keys.
//!
//! Head dimension `d` is cut into halves; entry `i < d/2` pairs with entry `i + d/2` (Hugging
//! Face's "rotate half" layout, the one its Llama checkpoints use). At position `p` the pair
//! `(x₁, x₂)` turns by the angle `p·ωᵢ`:
//!
//! `x₁' = x₁ cos(p·ωᵢ) − x₂ sin(p·ωᵢ)`, `x₂' = x₂ cos(p·ωᵢ) + x₁ sin(p·ωᵢ)`,
//!
//! with `ωᵢ = θ^(−2i/d)`, optionally rescaled by Llama 3.1's long-context rule
//! ([`Llama3Scaling`]). The angles and their cosines and sines are computed in f64 and rounded
//! once to f32, so a rotation is as exact at position 100,000 as at position 1.

use std::f64::consts::PI;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorData};
use serde::{Deserialize, Serialize};
use wildfire_backend::DecoratedBackend;
use wildfire_backend::kernels::rope::rope as fused_rope;
use wildfire_parallel::precision::in_dtype;

/// Llama 3.1's frequency scaling (`rope_type: "llama3"` in Hugging Face configs): frequencies
/// whose wavelength is shorter than `original_context / high_freq_factor` stay, those longer
/// than `original_context / low_freq_factor` are divided by `factor`, and those in between move
/// smoothly from one to the other:
/// `ω' = (1 − s)·ω/factor + s·ω`, `s = (original_context/λ − low) / (high − low)`, `λ = 2π/ω`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    /// The context the model was first trained at (`original_max_position_embeddings`).
    pub original_context: usize,
}

impl Llama3Scaling {
    /// The scaling of Llama 3.1 (factor 8) and, with `factor` 32, of Llama 3.2.
    pub fn llama3(factor: f64) -> Self {
        Self {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192,
        }
    }

    /// `ω` rescaled by the rule in the type's doc.
    pub fn scale(&self, omega: f64) -> f64 {
        let wavelength = 2.0 * PI / omega;
        let context = self.original_context as f64;
        if wavelength < context / self.high_freq_factor {
            omega
        } else if wavelength > context / self.low_freq_factor {
            omega / self.factor
        } else {
            let smooth = (context / wavelength - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * omega / self.factor + smooth * omega
        }
    }

    /// Checks the factors; a message names the field and its value.
    pub fn validate(&self) -> Result<(), String> {
        if self.factor.is_nan() || self.factor < 1.0 {
            return Err(format!(
                "model.rope_scaling.factor = {} is below 1",
                self.factor
            ));
        }
        let ordered = self.low_freq_factor > 0.0 && self.high_freq_factor > self.low_freq_factor;
        if !ordered {
            return Err(format!(
                "model.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got {} and {}",
                self.low_freq_factor, self.high_freq_factor
            ));
        }
        if self.original_context == 0 {
            return Err("model.rope_scaling.original_context must be at least 1, got 0".into());
        }
        Ok(())
    }
}

/// The frequencies `ω₀ … ω_{d/2−1}` of a head of width `head_dim`.
pub fn frequencies(head_dim: usize, theta: f64, scaling: Option<&Llama3Scaling>) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| {
            let omega = theta.powf(-2.0 * i as f64 / head_dim as f64);
            scaling.map_or(omega, |s| s.scale(omega))
        })
        .collect()
}

/// The cosines and sines of every angle `p·ωᵢ` for positions `0..positions`, row `p` holding
/// the angles of position `p` for both halves of a head (`d` entries, the `d/2` angles twice).
#[derive(Debug, Clone)]
pub struct Rotary {
    cos: Arc<[f32]>,
    sin: Arc<[f32]>,
    half: usize,
    positions: usize,
}

/// `R` with `x·R = (−x₂, x₁)` for `x = (x₁, x₂)`, halves of width `half`: one ±1 per column, so
/// the product is exact (every other term adds a zero).
fn rotate_half_matrix(half: usize) -> Vec<f32> {
    let d = 2 * half;
    let mut r = vec![0.0; d * d];
    for i in 0..half {
        r[(i + half) * d + i] = -1.0;
        r[i * d + i + half] = 1.0;
    }
    r
}

impl Rotary {
    pub fn new(
        head_dim: usize,
        positions: usize,
        theta: f64,
        scaling: Option<&Llama3Scaling>,
    ) -> Self {
        let omegas = frequencies(head_dim, theta, scaling);
        let row = |p: usize| omegas.iter().chain(&omegas).map(move |w| p as f64 * w);
        let angles = || (0..positions).flat_map(row);
        Self {
            cos: angles().map(|a| a.cos() as f32).collect(),
            sin: angles().map(|a| a.sin() as f32).collect(),
            half: head_dim / 2,
            positions,
        }
    }

    /// `x: [batch, seq, heads, head_dim]`, rotated as for positions `start .. start + seq`, as
    /// the fused op ([`fused_rope`], which keeps only the tables for the backward) when `fused`,
    /// else as [`Self::apply_composed`] (equal to it exactly). The product is computed in `x`'s
    /// type (the tables rounded to it), as Hugging Face's Llama does.
    pub fn apply<B: DecoratedBackend>(
        &self,
        x: Tensor<B, 4>,
        start: usize,
        fused: bool,
    ) -> Tensor<B, 4> {
        if !fused {
            return self.apply_composed(x, start);
        }
        let [_, seq, _, width] = x.dims();
        self.check_positions(width, start, seq);
        let (dtype, device) = (FloatDType::from(x.dtype()), x.device());
        let table = |values: &[f32]| {
            let rows = values[start * width..(start + seq) * width].to_vec();
            in_dtype(
                Tensor::<B, 2>::from_data(TensorData::new(rows, [seq, width]), &device),
                dtype,
            )
        };
        fused_rope(x, table(&self.cos), table(&self.sin))
    }

    /// Checks that the tables are for heads of `width` and hold positions `start..start + seq`.
    fn check_positions(&self, width: usize, start: usize, seq: usize) {
        assert_eq!(
            width,
            2 * self.half,
            "RoPE tables for head dim {}",
            2 * self.half
        );
        assert!(
            start + seq <= self.positions,
            "positions {start}..{} are beyond the model's context of {}",
            start + seq,
            self.positions
        );
    }

    /// [`Self::apply`] in Burn ops: `x·cos + (x·R)·sin` with [`rotate_half_matrix`]'s `R` (a
    /// matmul, where slicing the halves apart and joining them again copies strided data twice
    /// each way).
    pub fn apply_composed<B: Backend>(&self, x: Tensor<B, 4>, start: usize) -> Tensor<B, 4> {
        let [batch, seq, heads, width] = x.dims();
        self.check_positions(width, start, seq);
        let (dtype, device) = (FloatDType::from(x.dtype()), x.device());
        let tensor = |values: Vec<f32>, shape: [usize; 3]| {
            in_dtype(
                Tensor::<B, 3>::from_data(TensorData::new(values, shape), &device),
                dtype,
            )
        };
        // Each position's row repeated for every head: `[1, seq, heads·width]`, which the
        // products broadcast over the batch only (a broadcast inside the shape takes the
        // backend's strided path, several times slower on Flex).
        let table = |values: &[f32]| {
            let rows = values[start * width..(start + seq) * width].chunks(width);
            let tiled = rows.flat_map(|row| row.repeat(heads)).collect();
            tensor(tiled, [1, seq, heads * width])
        };
        let (cos, sin) = (table(&self.cos), table(&self.sin));
        let r = tensor(rotate_half_matrix(self.half), [1, width, width]);
        let x = x.reshape([batch, seq, heads * width]);
        let rotated = x
            .clone()
            .reshape([1, batch * seq * heads, width])
            .matmul(r)
            .reshape([batch, seq, heads * width]);
        (x * cos + rotated * sin).reshape([batch, seq, heads, width])
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use wildfire_backend::Parallel;

    use super::*;

    /// The rotation at positions far apart against the closed form in f64, fused and composed
    /// (which agree exactly). The tables are rounded once from f64 (|error| ≤ 2⁻²⁴ each), and
    /// the product adds two f32 roundings: with inputs in [−1, 1] every output is within 4e-7 of
    /// the exact value.
    #[test]
    fn rotation_matches_the_closed_form_at_any_position() {
        let (head_dim, theta) = (8, 10_000.0);
        let x: Vec<f32> = (0..head_dim)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) / 5.0)
            .collect();
        let omegas = frequencies(head_dim, theta, None);
        let rotary = Rotary::new(head_dim, 100_001, theta, None);
        for position in [0usize, 1, 1000, 100_000] {
            let input = Tensor::<Parallel<Flex>, 4>::from_data(
                TensorData::new(x.clone(), [1, 1, 1, head_dim]),
                &Default::default(),
            );
            let rotated = |fused| -> Vec<f32> {
                let y = rotary.apply(input.clone(), position, fused);
                y.into_data().to_vec().unwrap()
            };
            let got = rotated(true);
            assert_eq!(got, rotated(false), "fused and composed at {position}");
            for i in 0..head_dim / 2 {
                let angle = position as f64 * omegas[i];
                let (x1, x2) = (x[i] as f64, x[i + head_dim / 2] as f64);
                let expected = [
                    x1 * angle.cos() - x2 * angle.sin(),
                    x2 * angle.cos() + x1 * angle.sin(),
                ];
                for (got, expected) in [got[i], got[i + head_dim / 2]].iter().zip(expected) {
                    assert!(
                        (*got as f64 - expected).abs() <= 4e-7,
                        "position {position}, pair {i}: {got} against {expected}"
                    );
                }
            }
        }
    }

    /// Llama 3.1's rule at the three regions' sample frequencies, against the formula written
    /// out: high frequencies kept, low ones divided by the factor, the middle interpolated.
    #[test]
    fn llama3_scaling_follows_its_formula() {
        let scaling = Llama3Scaling::llama3(8.0);
        let wavelength = |w: f64| 2.0 * PI / w;
        // Wavelength 100 < 8192 / 4: kept.
        let high = 2.0 * PI / 100.0;
        assert_eq!(scaling.scale(high), high);
        // Wavelength 10,000 > 8192: divided by 8.
        let low = 2.0 * PI / 10_000.0;
        assert_eq!(scaling.scale(low), low / 8.0);
        // Wavelength 4096: s = (8192/4096 − 1) / 3 = 1/3.
        let middle = 2.0 * PI / 4096.0;
        let s = (8192.0 / wavelength(middle) - 1.0) / 3.0;
        assert!((s - 1.0 / 3.0).abs() < 1e-12);
        let expected = (1.0 - s) * middle / 8.0 + s * middle;
        assert!((scaling.scale(middle) - expected).abs() <= 1e-18);
        // Every frequency of a Llama 3 head stays within [ω/8, ω] and keeps the order.
        let plain = frequencies(128, 500_000.0, None);
        let scaled = frequencies(128, 500_000.0, Some(&scaling));
        for (w, s) in plain.iter().zip(&scaled) {
            assert!(*s <= *w && *s >= w / 8.0, "{s} outside [{}, {w}]", w / 8.0);
        }
        assert!(scaled.windows(2).all(|p| p[1] < p[0]));
    }
}
