//! Which of a model's fusable ops run as one fused op (with its fused backward) and which as
//! Burn's decomposed ops, per op and per device; and whether AdamW's step runs as one pass.
//!
//! A fused op is not faster everywhere: on one H200, wildfire's CubeCL attention ran forward and
//! backward 14× slower than Burn's decomposed attention while its bias + GELU ran 3.4× faster
//! (docs/benchmarks/gpu.md). So each op has its own switch, and each device kind its defaults:
//! an op is fused by default only where it was measured to win, and a CUDA kernel that no GPU
//! run has verified stays off there ([`FusedOps::device_default`]). A run may set all of them
//! at once ([`FusedOps::all`]) and then override single ops ([`FusedOps::with`]), as the
//! recipe's `train.fused_ops` and `train.fused.<op>` do.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::device::DeviceKind;

/// An op a model may run fused or decomposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FusedOp {
    /// The attention core, `softmax(QKᵀ/√d + M)V` ([`super::attention`]).
    Attention,
    /// The MLP's bias add + GELU ([`super::bias_gelu`]).
    BiasGelu,
    /// LayerNorm ([`super::layer_norm`], centred).
    LayerNorm,
    /// RMSNorm ([`super::layer_norm`], uncentred).
    RmsNorm,
    /// The rotary position embedding ([`super::rope`]).
    Rope,
    /// The gated MLP's `silu(g) ∘ u` ([`super::swiglu`]).
    Swiglu,
    /// AdamW's step, one pass per parameter tensor ([`super::adamw`]).
    Adamw,
    /// The output head's product and cross-entropy in blocks of rows, without the whole
    /// logits ([`super::cross_entropy`]).
    CrossEntropy,
}

impl FusedOp {
    /// Every op, in the order the log lists them.
    pub const ALL: [FusedOp; 8] = [
        Self::Attention,
        Self::BiasGelu,
        Self::LayerNorm,
        Self::RmsNorm,
        Self::Rope,
        Self::Swiglu,
        Self::Adamw,
        Self::CrossEntropy,
    ];

    /// The op's name in configs and logs (`bias_gelu`, `rms_norm`, …).
    pub fn name(self) -> &'static str {
        match self {
            Self::Attention => "attention",
            Self::BiasGelu => "bias_gelu",
            Self::LayerNorm => "layer_norm",
            Self::RmsNorm => "rms_norm",
            Self::Rope => "rope",
            Self::Swiglu => "swiglu",
            Self::Adamw => "adamw",
            Self::CrossEntropy => "cross_entropy",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

impl fmt::Display for FusedOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for FusedOp {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|op| op.name() == text)
            .ok_or_else(|| {
                let names: Vec<_> = Self::ALL.iter().map(|op| op.name()).collect();
                format!(
                    "unknown fused op {text:?} (expected one of {})",
                    names.join(", ")
                )
            })
    }
}

/// Which ops run fused: one switch per [`FusedOp`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct FusedOps {
    fused: u8,
}

impl FusedOps {
    /// Every op fused (`true`) or every op decomposed (`false`).
    pub fn all(fused: bool) -> Self {
        let every = FusedOp::ALL.iter().fold(0, |bits, op| bits | op.bit());
        Self {
            fused: if fused { every } else { 0 },
        }
    }

    /// The defaults of a device kind: each op fused only where it was measured to win there.
    ///
    /// - CPU (Flex's native loops) and wgpu (the CubeCL kernels, measured on lavapipe): every
    ///   op; each was faster and kept less than its decomposed form (docs/benchmarks/train.md,
    ///   llama.md, kernels.md; the blocked cross-entropy, Burn's ops on either, was measured on
    ///   the CPU, activations.md).
    /// - CUDA: bias + GELU only, the one kernel measured on a GPU to win (3.4× on an H200).
    ///   The attention kernel measured 14× slower there than Burn's decomposed attention, and the
    ///   norm, RoPE, SwiGLU and AdamW kernels have not run on a GPU: they stay off until a GPU
    ///   run verifies them. So does the blocked cross-entropy (Burn's ops, no kernel of its
    ///   own), whose blocks of a few dozen rows are sized for memory, not for a GPU's products.
    pub fn device_default(kind: DeviceKind) -> Self {
        match kind {
            DeviceKind::Cpu | DeviceKind::Wgpu => Self::all(true),
            DeviceKind::Cuda => Self::all(false).with(FusedOp::BiasGelu, true),
        }
    }

    /// The same choice with `op` fused (`true`) or decomposed.
    pub fn with(self, op: FusedOp, fused: bool) -> Self {
        let fused = match fused {
            true => self.fused | op.bit(),
            false => self.fused & !op.bit(),
        };
        Self { fused }
    }

    /// Whether `op` runs fused.
    pub fn is_fused(self, op: FusedOp) -> bool {
        self.fused & op.bit() != 0
    }
}

impl Default for FusedOps {
    /// Every op fused.
    fn default() -> Self {
        Self::all(true)
    }
}

/// `attention fused, bias_gelu decomposed, …`: what the run's log says of its ops.
impl fmt::Display for FusedOps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ops: Vec<_> = FusedOp::ALL
            .iter()
            .map(|&op| {
                let how = if self.is_fused(op) {
                    "fused"
                } else {
                    "decomposed"
                };
                format!("{op} {how}")
            })
            .collect();
        f.write_str(&ops.join(", "))
    }
}

impl fmt::Debug for FusedOps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FusedOps({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CUDA fuses only what a GPU run measured to win; the CPU and wgpu fuse everything.
    #[test]
    fn each_device_fuses_what_was_measured_to_win_there() {
        for kind in [DeviceKind::Cpu, DeviceKind::Wgpu] {
            let ops = FusedOps::device_default(kind);
            assert!(
                FusedOp::ALL.iter().all(|&op| ops.is_fused(op)),
                "{kind:?}: {ops}"
            );
        }
        let cuda = FusedOps::device_default(DeviceKind::Cuda);
        for op in FusedOp::ALL {
            assert_eq!(cuda.is_fused(op), op == FusedOp::BiasGelu, "cuda: {cuda}");
        }
        assert_eq!(
            cuda.to_string(),
            "attention decomposed, bias_gelu fused, layer_norm decomposed, rms_norm decomposed, \
             rope decomposed, swiglu decomposed, adamw decomposed, cross_entropy decomposed"
        );
    }

    /// `with` changes one op and nothing else, both ways, from either end.
    #[test]
    fn with_sets_one_op() {
        for op in FusedOp::ALL {
            let on = FusedOps::all(false).with(op, true);
            let off = FusedOps::all(true).with(op, false);
            for other in FusedOp::ALL {
                assert_eq!(on.is_fused(other), other == op, "{op} on: {on}");
                assert_eq!(off.is_fused(other), other != op, "{op} off: {off}");
            }
            assert_eq!(on.with(op, false), FusedOps::all(false));
            assert_eq!(off.with(op, true), FusedOps::all(true));
        }
    }

    /// Names round-trip through `FromStr`; an unknown one is named with the known ones.
    #[test]
    fn op_names_parse_and_unknown_ones_are_named() {
        for op in FusedOp::ALL {
            assert_eq!(op.name().parse::<FusedOp>(), Ok(op));
        }
        let error = "gelu".parse::<FusedOp>().unwrap_err();
        assert_eq!(
            error,
            "unknown fused op \"gelu\" (expected one of attention, bias_gelu, layer_norm, \
             rms_norm, rope, swiglu, adamw, cross_entropy)"
        );
    }
}
