//! Mixed-precision matmul: inputs rounded to f16 or bf16, products accumulated in f32, an
//! optional epilogue (bias add, then GELU), output in any float type; batched.
//!
//! For `lhs [.., m, k]` and `rhs [.., k, n]` the result is
//! `out[.., i, j] = g(Σₗ r(lhs[.., i, l])·r(rhs[.., l, j]) + bias[j])`, with `r` the rounding to
//! the compute type and `g` GPT-2's GELU or the identity. A product of two f16 (11-bit
//! significands) or two bf16 (8-bit) values is exact in f32 (24-bit), so the only rounding after
//! `r` is the f32 summation's, and the one to the output type.
//!
//! Two implementations with one meaning:
//! - **the CubeCL path** ([`kernel`]): the inputs cast to the compute type and multiplied by
//!   cuBLASLt where its tier takes them ([`vendor`]: CUDA, off by default), else by
//!   Burn's own CubeCL matmul (cubek-matmul, on tensor cores where the device has them;
//!   autotuned in a build with `cuda`, which turns on Burn's `autotune`, one fixed kernel
//!   otherwise), which accumulates f16 and bf16 inputs in f32; then, when there is a bias or GELU,
//!   our epilogue kernel, one pass over the f32 product that adds the bias, applies GELU and
//!   rounds to the output type. As in Megatron-LM's bias-GELU fusion, the epilogue is one
//!   elementwise kernel after the GEMM, not part of the GEMM's store: it replaces the two or
//!   three elementwise passes of the unfused ops. With f32 compute on CUDA the matmul may run on
//!   TF32 tensor cores, as Burn's own f32 matmul does;
//! - **the reference** in Burn ops (Flex, or whatever the CubeCL path declines): round to the
//!   compute type, compute in f32 with the backend's own matmul, apply the epilogue in f32.
//!
//! [`MatmulPrecision`] is the policy that sends every float matmul of `Parallel<B>` — forward
//! and backward alike under `Autodiff<Parallel<B>>` — through this op (`decorator/overrides.rs`),
//! like PyTorch's `torch.set_float32_matmul_precision`: it is process-wide.

use std::sync::atomic::{AtomicU8, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Tensor, TensorMetadata};

use super::route::{on_cube, took_reference};
use super::tensor;
pub use cube::kernel;

mod cube;
pub mod flex;
pub mod gemm_plan;
pub mod vendor;

/// Which type the float matmuls of `Parallel<B>` compute in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MatmulPrecision {
    /// The backend's own matmul, in the inputs' type.
    #[default]
    Off,
    /// Inputs rounded to bf16, accumulated in f32, returned in the inputs' type.
    Bf16,
    /// Inputs rounded to f16, accumulated in f32, returned in the inputs' type.
    F16,
    /// TF32 tensor cores (inputs rounded to a 10-bit mantissa, accumulated in f32), PyTorch's
    /// `set_float32_matmul_precision("high")`: CUDA devices only. It is the backend's own
    /// matmul: Burn 0.21's CUDA matmul (cubek-matmul) already stages f32 inputs as TF32
    /// wherever its tensor-core kernel runs, so on CUDA `Off` computes alike. Under the vendor
    /// tier ([`vendor`]) it tells cuBLASLt to use TF32, which `Off` does not.
    Tf32,
}

impl MatmulPrecision {
    /// The type inputs are rounded to, or `None` when the policy is off.
    pub fn compute_dtype(self) -> Option<FloatDType> {
        match self {
            Self::Off => None,
            Self::Bf16 => Some(FloatDType::BF16),
            Self::F16 => Some(FloatDType::F16),
            Self::Tf32 => None,
        }
    }
}

impl std::str::FromStr for MatmulPrecision {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "off" => Ok(Self::Off),
            "bf16" => Ok(Self::Bf16),
            "f16" | "fp16" => Ok(Self::F16),
            "tf32" => Ok(Self::Tf32),
            _ => Err(format!(
                "unknown matmul precision {text:?} (expected off, bf16, f16 or tf32)"
            )),
        }
    }
}

impl std::fmt::Display for MatmulPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::Tf32 => "tf32",
        })
    }
}

static POLICY: AtomicU8 = AtomicU8::new(0);

/// Sets the process-wide matmul precision policy (every rank of a job sets the same).
pub fn set_matmul_precision(precision: MatmulPrecision) {
    POLICY.store(precision as u8, Ordering::Relaxed);
}

/// The process-wide matmul precision policy (off until set).
pub fn matmul_precision() -> MatmulPrecision {
    match POLICY.load(Ordering::Relaxed) {
        1 => MatmulPrecision::Bf16,
        2 => MatmulPrecision::F16,
        3 => MatmulPrecision::Tf32,
        _ => MatmulPrecision::Off,
    }
}

/// What a mixed-precision matmul computes in and returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MixedMatmul {
    /// The type the inputs are rounded to (f16 or bf16; f32 leaves them as they are).
    pub compute: FloatDType,
    /// The output's type.
    pub output: FloatDType,
    /// Whether GPT-2's GELU follows the bias add.
    pub gelu: bool,
}

/// `g(r(lhs)·r(rhs) + bias)` on `Tensor`s (see the module doc); `bias` is `[n]`.
pub fn mixed_matmul<B: Backend, const D: usize>(
    lhs: Tensor<B, D>,
    rhs: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
    spec: MixedMatmul,
) -> Tensor<B, D> {
    let primitive = |t: Tensor<B, D>| t.into_primitive().tensor();
    let [lhs, rhs] = [lhs, rhs].map(primitive);
    let output = match bias {
        None => on_cube(&spec, [lhs, rhs])
            .map(|[out]| out)
            .map_err(|[l, r]| (l, r, None)),
        Some(bias) => {
            let bias = bias.into_primitive().tensor();
            on_cube(&spec, [lhs, rhs, bias])
                .map(|[out]| out)
                .map_err(|[l, r, b]| (l, r, Some(b)))
        }
    };
    match output {
        Ok(output) => tensor(output),
        Err((lhs, rhs, bias)) => {
            took_reference(cube::OP);
            tensor(reference_on::<B>(lhs, rhs, bias, spec))
        }
    }
}

/// The reference: rounding to the compute type, then the backend's matmul and the epilogue in
/// f32.
pub fn reference<B: Backend, const D: usize>(
    lhs: Tensor<B, D>,
    rhs: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
    spec: MixedMatmul,
) -> Tensor<B, D> {
    let primitive = |t: Tensor<B, D>| t.into_primitive().tensor();
    let bias = bias.map(|bias| bias.into_primitive().tensor());
    tensor(reference_on::<B>(
        primitive(lhs),
        primitive(rhs),
        bias,
        spec,
    ))
}

/// [`reference`] on primitives of any rank.
pub(crate) fn reference_on<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    spec: MixedMatmul,
) -> FloatTensor<B> {
    let product = rounded_product::<B>(lhs, rhs, spec.compute);
    let shape = product.shape();
    // The epilogue is elementwise per column: on the product's rows, `[.., n]` as `[rows, n]`.
    let mut out = super::as_rows::<B>(product);
    if let Some(bias) = bias {
        out = out + super::in_dtype(tensor::<B, 1>(bias), FloatDType::F32).unsqueeze();
    }
    if spec.gelu {
        out = super::gelu_tanh_f32(out);
    }
    B::float_reshape(
        super::in_dtype(out, spec.output).into_primitive().tensor(),
        shape,
    )
}

/// The policy's matmul on primitives of any rank: `r(lhs)·r(rhs)` in f32, returned in `lhs`'s
/// type (no epilogue). `Parallel<B>::float_matmul` calls it when the policy is on.
pub(crate) fn policy_matmul<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    compute: FloatDType,
) -> FloatTensor<B> {
    let output = FloatDType::from(lhs.dtype());
    let spec = MixedMatmul {
        compute,
        output,
        gelu: false,
    };
    match on_cube(&spec, [lhs, rhs]) {
        Ok([out]) => out,
        Err([lhs, rhs]) => {
            took_reference(cube::OP);
            B::float_cast(rounded_product::<B>(lhs, rhs, compute), output)
        }
    }
}

/// `r(lhs)·r(rhs)` in f32 with the backend's own matmul, `r` the rounding to `compute`: the
/// reference's product.
fn rounded_product<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    compute: FloatDType,
) -> FloatTensor<B> {
    let round = |t| B::float_cast(B::float_cast(t, compute), FloatDType::F32);
    B::float_matmul(round(lhs), round(rhs))
}
