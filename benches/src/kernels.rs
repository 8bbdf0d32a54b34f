//! `kernels`: wildfire's CubeCL kernels against Burn's own ops on the same device, in one run,
//! alternating in rounds so both sides see the same machine noise. Both run on the backend
//! `wildfire train --device` uses: Burn's CubeCL backend under Burn's fusion (our kernels queued
//! in its stream as custom operations, Burn's ops fused where its fusers can), or with
//! `--unfused` on the bare backend (one kernel per op).
//!
//! - **attention**, forward and forward+backward: `fused_attention` on `Parallel<B>` and
//!   `Autodiff<Parallel<B>>` (the FlashAttention-2 kernels) against
//!   Burn's `attention` on `B` and `Autodiff<B>` (on wgpu and CUDA without Burn's `autotune`
//!   feature that is its decomposed fallback). FLOPs counted as FlashAttention-2 does: the
//!   forward's two matmuls are `4·b·h·s²·d` (half that under the causal mask), the backward's
//!   five are 2.5× the forward's.
//! - **matmul**: the mixed-precision matmul (inputs in the compute type, f32 accumulation,
//!   output in the compute type) against Burn's matmul in the same type, `2·m·n·k` FLOPs; and
//!   with its bias + GELU epilogue against Burn's matmul followed by the same two ops.
//! - **bias + GELU, SwiGLU and RoPE forward+backward**: the fused ops (`kernels::bias_gelu`,
//!   `kernels::swiglu`, `kernels::rope`, one kernel each way) against the same computations in
//!   Burn ops under autodiff; elementwise, so times only.
//! - **LayerNorm and RMSNorm forward+backward**: `kernels::layer_norm` (one kernel forward,
//!   three backward) against Burn's `LayerNorm` and `RmsNorm` modules under autodiff.
//!
//! The attention forward and the plain matmul are also compared with Burn's output (`difference`:
//! max |ours − Burn's| / max |Burn's|). With `--targets` it checks the GPU targets (attention
//! forward+backward ≥ 400 TFLOP/s; matmul ≥ 70% of `--peak-tflops`) and those differences
//! (within [`difference_tolerance`]), and exits non-zero on a miss.

use std::time::Instant;

use anyhow::{Context, Error, bail};
use burn::backend::Autodiff;
use burn::module::Param;
use burn::nn::{LayerNormConfig, RmsNormConfig};
use burn::tensor::activation::silu;
use burn::tensor::backend::Backend;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{DType, Distribution, ElementConversion, FloatDType, Tensor, TensorPrimitive};
use clap::{Args, ValueEnum};
use serde::Serialize;
use wildfire_backend::Parallel;
use wildfire_backend::device::FusedWgpu;
use wildfire_backend::kernels::attention::fused_attention;
use wildfire_backend::kernels::bias_gelu::bias_gelu;
use wildfire_backend::kernels::gelu_tanh_f32;
use wildfire_backend::kernels::layer_norm::{layer_norm, rms_norm};
use wildfire_backend::kernels::matmul::vendor::{set_vendor_matmul, vendor_matmul};
use wildfire_backend::kernels::matmul::{MixedMatmul, mixed_matmul};
use wildfire_backend::kernels::probe;
use wildfire_backend::kernels::rope::{reference as rope_reference, rope};
use wildfire_backend::kernels::route::{cube_runtime, set_kernels_enabled};
use wildfire_backend::kernels::swiglu::swiglu;

use crate::{median, print_json_lines};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Device {
    /// wgpu's default adapter (Mesa's lavapipe on CPU-only machines).
    Wgpu,
    /// The first CUDA GPU (needs `--features cuda`).
    Cuda,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Precision {
    F32,
    F16,
    Bf16,
}

impl From<Precision> for FloatDType {
    fn from(precision: Precision) -> Self {
        match precision {
            Precision::F32 => FloatDType::F32,
            Precision::F16 => FloatDType::F16,
            Precision::Bf16 => FloatDType::BF16,
        }
    }
}

#[derive(Debug, Args)]
pub struct KernelArgs {
    #[arg(long, value_enum, default_value = "wgpu")]
    device: Device,
    /// The type of the inputs (computed in f32 by the kernels).
    #[arg(long, value_enum, default_value = "f16")]
    dtype: Precision,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 256)]
    seq: usize,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// m = n = k of the matmul.
    #[arg(long, default_value_t = 256)]
    matmul_size: usize,
    /// Alternating rounds (ours, Burn's) per measurement.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Check the GPU targets and fail on a miss.
    #[arg(long)]
    targets: bool,
    /// The device's dense peak in `--dtype`, TFLOP/s (H100/H200 SXM bf16: 989), for the
    /// matmul target.
    #[arg(long)]
    peak_tflops: Option<f64>,
    /// Print one JSON object per line instead of the table.
    #[arg(long)]
    json: bool,
    /// Run on Burn's bare CubeCL backend (one kernel per op) instead of the fused one that
    /// `wildfire train --device` uses (Burn's fusion; our kernels queued in its stream).
    #[arg(long)]
    unfused: bool,
    /// Also time cuBLASLt (the matmuls' vendor tier, switched on for these rows) against Burn's
    /// CubeCL matmul at `--matmul-size`³ and at the GEMM shapes of a GPT-2 124M and a Llama 3
    /// 8B training step of 8192 tokens ([`GEMM_SHAPES`]); CUDA only.
    #[arg(long)]
    gemm_shapes: bool,
}

/// The GEMMs of one training step's forward, `[tokens, k] · [k, n]`, for 8192 tokens (8 × 1024):
/// GPT-2 124M (width 768, MLP 3072, vocabulary 50,304 padded) and Llama 3 8B (width 4096, Q
/// with K and V of 8 heads of 128 = 6144, MLP 14,336, vocabulary 128,256).
/// benches/reference/kernels_torch.py times the same shapes with `torch.matmul`.
pub const GEMM_SHAPES: [(&str, [usize; 3]); 10] = [
    ("gpt2 qkv", [8192, 768, 2304]),
    ("gpt2 attn out", [8192, 768, 768]),
    ("gpt2 mlp up", [8192, 768, 3072]),
    ("gpt2 mlp down", [8192, 3072, 768]),
    ("gpt2 head", [8192, 768, 50304]),
    ("llama8b qkv", [8192, 4096, 6144]),
    ("llama8b attn out", [8192, 4096, 4096]),
    ("llama8b gate+up", [8192, 4096, 28672]),
    ("llama8b mlp down", [8192, 14336, 4096]),
    ("llama8b head", [8192, 4096, 128256]),
];

#[derive(Debug, Serialize)]
struct Record {
    op: String,
    shape: String,
    dtype: String,
    ours_ms: f64,
    burn_ms: f64,
    ours_tflops: f64,
    burn_tflops: f64,
    /// burn_ms / ours_ms: above 1, ours is faster.
    speedup: f64,
    /// max |ours − Burn's| / max |Burn's| over the output, where the two compute the same.
    difference: Option<f64>,
}

pub fn run(args: KernelArgs) -> anyhow::Result<()> {
    set_kernels_enabled(true);
    match (args.device, args.unfused) {
        (Device::Wgpu, false) => bench::<FusedWgpu>(&args, &probe::wgpu().map_err(Error::msg)?),
        (Device::Wgpu, true) => {
            bench::<burn::backend::Wgpu>(&args, &probe::wgpu().map_err(Error::msg)?)
        }
        #[cfg(feature = "cuda")]
        (Device::Cuda, false) => {
            bench::<wildfire_backend::device::FusedCuda>(&args, &probe::cuda().map_err(Error::msg)?)
        }
        #[cfg(feature = "cuda")]
        (Device::Cuda, true) => {
            bench::<burn::backend::Cuda>(&args, &probe::cuda().map_err(Error::msg)?)
        }
        #[cfg(not(feature = "cuda"))]
        (Device::Cuda, _) => bail!("--device cuda needs a build with `--features cuda`"),
    }
}

fn bench<B: Backend>(args: &KernelArgs, device: &B::Device) -> anyhow::Result<()> {
    let runtime = cube_runtime::<B::FloatTensorPrimitive>()
        .context("the kernels run on CubeCL backends only")?;
    let dtype = FloatDType::from(args.dtype);
    if !B::supports_dtype(device, DType::from(dtype)) {
        bail!("{runtime} device {device:?} has no {dtype:?} arithmetic");
    }
    if args.gemm_shapes && runtime != "cuda" {
        bail!("--gemm-shapes times cuBLASLt, which runs on CUDA only (this is {runtime})");
    }
    let mut records = Vec::new();
    for causal in [true, false] {
        records.extend(attention_records::<B>(args, device, dtype, causal));
    }
    records.extend(matmul_records::<B>(args, device, dtype));
    if args.gemm_shapes {
        records.extend(gemm_records::<B>(args, device, dtype));
    }
    records.push(bias_gelu_record::<B>(args, device, dtype));
    records.push(swiglu_record::<B>(args, device, dtype));
    records.push(rope_record::<B>(args, device, dtype));
    for centred in [true, false] {
        records.push(norm_record::<B>(args, device, dtype, centred));
    }
    report(&records, args.json)?;
    if args.targets {
        check_targets(&records, dtype, args.peak_tflops)?;
    }
    Ok(())
}

/// The median seconds of `op` over `rounds`, alternating with `other` (whose times are
/// returned second); each call ends with the device synchronised.
fn alternate<B: Backend>(
    device: &B::Device,
    rounds: usize,
    mut op: impl FnMut(),
    mut other: impl FnMut(),
) -> (f64, f64) {
    let time = |f: &mut dyn FnMut()| {
        let start = Instant::now();
        f();
        B::sync(device).expect("device sync");
        start.elapsed().as_secs_f64()
    };
    // One warm-up each: kernel compilation and allocation.
    time(&mut op);
    time(&mut other);
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        if round % 2 == 0 {
            ours.push(time(&mut op));
            theirs.push(time(&mut other));
        } else {
            theirs.push(time(&mut other));
            ours.push(time(&mut op));
        }
    }
    (median(&mut ours), median(&mut theirs))
}

/// `max |ours − theirs| / max |theirs|`, computed in f32 on the device.
fn relative_difference<B: Backend, const D: usize>(
    ours: Tensor<B, D>,
    theirs: Tensor<B, D>,
) -> f64 {
    let [ours, theirs] = [ours, theirs].map(|t| t.cast(FloatDType::F32));
    let worst = (ours - theirs.clone())
        .abs()
        .max()
        .into_scalar()
        .elem::<f64>();
    worst / theirs.abs().max().into_scalar().elem::<f64>()
}

fn record(op: &str, shape: String, dtype: FloatDType, flops: f64, times: (f64, f64)) -> Record {
    let (ours, burn) = times;
    Record {
        difference: None,
        op: op.to_string(),
        shape,
        dtype: format!("{dtype:?}"),
        ours_ms: ours * 1e3,
        burn_ms: burn * 1e3,
        ours_tflops: flops / ours / 1e12,
        burn_tflops: flops / burn / 1e12,
        speedup: burn / ours,
    }
}

fn attention_records<B: Backend>(
    args: &KernelArgs,
    device: &B::Device,
    dtype: FloatDType,
    causal: bool,
) -> Vec<Record> {
    let shape = [args.batch, args.heads, args.seq, args.head_dim];
    let draw = || Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype);
    let [q, k, v, output_grad] = [draw(), draw(), draw(), draw()];
    let options = AttentionModuleOptions {
        is_causal: causal,
        ..Default::default()
    };
    let mask = if causal { 0.5 } else { 1.0 };
    let forward_flops =
        mask * 4.0 * (args.batch * args.heads * args.head_dim) as f64 * (args.seq as f64).powi(2);
    let label = format!("{shape:?} causal {causal}");

    let forward = alternate::<B>(
        device,
        args.rounds,
        || {
            let _ = fused_attention(decorated(&q), decorated(&k), decorated(&v), causal);
        },
        || {
            let _ = attention(q.clone(), k.clone(), v.clone(), None, None, options);
        },
    );

    let training = alternate::<B>(
        device,
        args.rounds,
        || {
            let out = fused_attention(
                decorated_leaf(&q),
                decorated_leaf(&k),
                decorated_leaf(&v),
                causal,
            );
            let _ = (out * Tensor::from_inner(decorated(&output_grad)))
                .sum()
                .backward();
        },
        || {
            let out = attention(
                autodiff_leaf(&q),
                autodiff_leaf(&k),
                autodiff_leaf(&v),
                None,
                None,
                options,
            );
            let _ = (out * Tensor::from_inner(output_grad.clone()))
                .sum()
                .backward();
        },
    );
    let difference = relative_difference(
        fused_attention(decorated(&q), decorated(&k), decorated(&v), causal),
        Tensor::from_primitive(TensorPrimitive::Float(
            attention(q.clone(), k.clone(), v.clone(), None, None, options)
                .into_primitive()
                .tensor(),
        )),
    );
    vec![
        Record {
            difference: Some(difference),
            ..record(
                "attention fwd",
                label.clone(),
                dtype,
                forward_flops,
                forward,
            )
        },
        record(
            "attention fwd+bwd",
            label,
            dtype,
            3.5 * forward_flops,
            training,
        ),
    ]
}

fn matmul_records<B: Backend>(
    args: &KernelArgs,
    device: &B::Device,
    dtype: FloatDType,
) -> Vec<Record> {
    let size = args.matmul_size;
    let draw = |shape: [usize; 3]| {
        Tensor::<B, 3>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype)
    };
    let (lhs, rhs) = (draw([1, size, size]), draw([1, size, size]));
    let bias = Tensor::<B, 1>::random([size], Distribution::Normal(0.0, 1.0), device).cast(dtype);
    let flops = 2.0 * (size as f64).powi(3);
    let label = format!("{size}³");
    let plain = MixedMatmul {
        compute: dtype,
        output: dtype,
        gelu: false,
    };
    let matmul = alternate::<B>(
        device,
        args.rounds,
        || {
            let _ = mixed_matmul(lhs.clone(), rhs.clone(), None, plain);
        },
        || {
            let _ = lhs.clone().matmul(rhs.clone());
        },
    );
    let epilogue = alternate::<B>(
        device,
        args.rounds,
        || {
            let spec = MixedMatmul {
                gelu: true,
                ..plain
            };
            let _ = mixed_matmul(lhs.clone(), rhs.clone(), Some(bias.clone()), spec);
        },
        || {
            let biased = lhs.clone().matmul(rhs.clone()) + bias.clone().unsqueeze();
            let _ = gelu_tanh_f32(biased.cast(FloatDType::F32)).cast(dtype);
        },
    );
    let difference = relative_difference(
        mixed_matmul(lhs.clone(), rhs.clone(), None, plain),
        lhs.clone().matmul(rhs.clone()),
    );
    vec![
        Record {
            difference: Some(difference),
            ..record("matmul", label.clone(), dtype, flops, matmul)
        },
        record("matmul+bias+gelu", label, dtype, flops, epilogue),
    ]
}

/// cuBLASLt (through `Parallel<B>` with the vendor tier on) against Burn's CubeCL matmul (`B`'s
/// own), at `--matmul-size`³ and at [`GEMM_SHAPES`], `2·m·n·k` FLOPs each, with their outputs
/// compared. The tier is on for these rows only: under fusion the matmul runs when the device
/// synchronises, after the closure returns, so it stays on until every row is measured.
fn gemm_records<B: Backend>(
    args: &KernelArgs,
    device: &B::Device,
    dtype: FloatDType,
) -> Vec<Record> {
    let was_on = vendor_matmul();
    set_vendor_matmul(true);
    let size = args.matmul_size;
    let square = ("square", [size, size, size]);
    let records = std::iter::once(square)
        .chain(GEMM_SHAPES)
        .map(|(name, [m, k, n])| {
            let draw = |shape: [usize; 2]| {
                Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype)
            };
            let (lhs, rhs) = (draw([m, k]), draw([k, n]));
            let times = alternate::<B>(
                device,
                args.rounds,
                || {
                    let _ = decorated(&lhs).matmul(decorated(&rhs));
                },
                || {
                    let _ = lhs.clone().matmul(rhs.clone());
                },
            );
            let ours = decorated(&lhs).matmul(decorated(&rhs));
            let ours = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(
                ours.into_primitive().tensor(),
            ));
            let difference = relative_difference(ours, lhs.clone().matmul(rhs.clone()));
            let flops = 2.0 * (m * n * k) as f64;
            Record {
                difference: Some(difference),
                ..record(
                    &format!("{name} cuBLASLt"),
                    format!("{m}x{k}·{k}x{n}"),
                    dtype,
                    flops,
                    times,
                )
            }
        })
        .collect();
    set_vendor_matmul(was_on);
    records
}

/// The fused bias + GELU's forward and backward (`bias_gelu` on `Autodiff<Parallel<B>>`, one
/// kernel each way) against the same computation in Burn ops on `Autodiff<B>`, on an MLP hidden
/// of `[matmul_size, 4·matmul_size]` with its input and bias both needing gradients.
/// Elementwise work: no FLOPs are counted.
fn bias_gelu_record<B: Backend>(
    args: &KernelArgs,
    device: &B::Device,
    dtype: FloatDType,
) -> Record {
    let shape = [args.matmul_size, 4 * args.matmul_size];
    let normal = Distribution::Normal(0.0, 1.0);
    let x = Tensor::<B, 2>::random(shape, normal, device).cast(dtype);
    let output_grad = Tensor::<B, 2>::random(shape, normal, device).cast(dtype);
    let bias = Tensor::<B, 1>::random([shape[1]], normal, device);
    let times = alternate::<B>(
        device,
        args.rounds,
        || {
            let y = bias_gelu(decorated_leaf(&x), decorated_leaf(&bias));
            let _ = (y * Tensor::from_inner(decorated(&output_grad)))
                .sum()
                .backward();
        },
        || {
            let z = autodiff_leaf(&x).cast(FloatDType::F32) + autodiff_leaf(&bias).unsqueeze();
            let y = gelu_tanh_f32(z).cast(dtype);
            let _ = (y * Tensor::from_inner(output_grad.clone()))
                .sum()
                .backward();
        },
    );
    record("bias+gelu fwd+bwd", format!("{shape:?}"), dtype, 0.0, times)
}

/// `t` as a leaf of `Autodiff<Parallel<B>>` that needs its gradient.
fn decorated_leaf<B: Backend, const D: usize>(
    t: &Tensor<B, D>,
) -> Tensor<Autodiff<Parallel<B>>, D> {
    Tensor::from_inner(decorated(t)).require_grad()
}

/// `t` as a leaf of `Autodiff<B>` that needs its gradient.
fn autodiff_leaf<B: Backend, const D: usize>(t: &Tensor<B, D>) -> Tensor<Autodiff<B>, D> {
    Tensor::from_inner(t.clone()).require_grad()
}

/// The fused SwiGLU's forward and backward (`swiglu` on `Autodiff<Parallel<B>>`, one kernel each
/// way) against Burn's `silu(g)·u` (the model's composed form) on `Autodiff<B>`, on an MLP hidden
/// of `[matmul_size, 4·matmul_size]`. Elementwise work: no FLOPs are counted.
fn swiglu_record<B: Backend>(args: &KernelArgs, device: &B::Device, dtype: FloatDType) -> Record {
    let shape = [args.matmul_size, 4 * args.matmul_size];
    let draw = || Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype);
    let [gate, up, output_grad] = [draw(), draw(), draw()];
    let times = alternate::<B>(
        device,
        args.rounds,
        || {
            let y = swiglu(decorated_leaf(&gate), decorated_leaf(&up));
            let _ = (y * Tensor::from_inner(decorated(&output_grad)))
                .sum()
                .backward();
        },
        || {
            let gate = autodiff_leaf(&gate).cast(FloatDType::F32);
            let y = silu(gate).cast(dtype) * autodiff_leaf(&up);
            let _ = (y * Tensor::from_inner(output_grad.clone()))
                .sum()
                .backward();
        },
    );
    record("swiglu fwd+bwd", format!("{shape:?}"), dtype, 0.0, times)
}

/// The fused rotary embedding's forward and backward (`rope` on `Autodiff<Parallel<B>>`, one
/// kernel each way) against its reference in Burn ops on `Autodiff<B>`, on queries of
/// `[batch, seq, heads, head_dim]`. Elementwise work: no FLOPs are counted.
fn rope_record<B: Backend>(args: &KernelArgs, device: &B::Device, dtype: FloatDType) -> Record {
    let shape = [args.batch, args.seq, args.heads, args.head_dim];
    let normal = Distribution::Normal(0.0, 1.0);
    let x = Tensor::<B, 4>::random(shape, normal, device).cast(dtype);
    let output_grad = Tensor::<B, 4>::random(shape, normal, device).cast(dtype);
    let table = || Tensor::<B, 2>::random([args.seq, args.head_dim], normal, device).cast(dtype);
    let (cos, sin) = (table(), table());
    let times = alternate::<B>(
        device,
        args.rounds,
        || {
            let tables = [&cos, &sin].map(|t| Tensor::from_inner(decorated(t)));
            let [cos, sin] = tables;
            let y = rope(decorated_leaf(&x), cos, sin);
            let _ = (y * Tensor::from_inner(decorated(&output_grad)))
                .sum()
                .backward();
        },
        || {
            let (cos, sin) = (
                Tensor::from_inner(cos.clone()),
                Tensor::from_inner(sin.clone()),
            );
            let y = rope_reference(autodiff_leaf(&x), cos, sin);
            let _ = (y * Tensor::from_inner(output_grad.clone()))
                .sum()
                .backward();
        },
    );
    record("rope fwd+bwd", format!("{shape:?}"), dtype, 0.0, times)
}

/// The fused LayerNorm (`centred`) or RMSNorm forward and backward (`kernels::layer_norm` on
/// `Autodiff<Parallel<B>>`) against Burn's `LayerNorm` or `RmsNorm` module on `Autodiff<B>`,
/// on `[batch·seq, heads·head_dim]` activations, `γ` (and `β`) needing gradients too.
fn norm_record<B: Backend>(
    args: &KernelArgs,
    device: &B::Device,
    dtype: FloatDType,
    centred: bool,
) -> Record {
    const EPSILON: f64 = 1e-5;
    let shape = [args.batch * args.seq, args.heads * args.head_dim];
    let normal = Distribution::Normal(0.0, 1.0);
    let x = Tensor::<B, 2>::random(shape, normal, device).cast(dtype);
    let output_grad = Tensor::<B, 2>::random(shape, normal, device).cast(dtype);
    let parameter = || Tensor::<B, 1>::random([shape[1]], normal, device).cast(dtype);
    let (gamma, beta) = (parameter(), parameter());
    let times = alternate::<B>(
        device,
        args.rounds,
        || {
            let (x, gamma) = (decorated_leaf(&x), decorated_leaf(&gamma));
            let y = match centred {
                true => layer_norm(x, gamma, Some(decorated_leaf(&beta)), EPSILON),
                false => rms_norm(x, gamma, EPSILON),
            };
            let _ = (y * Tensor::from_inner(decorated(&output_grad)))
                .sum()
                .backward();
        },
        || {
            let y = match centred {
                true => {
                    let mut norm = LayerNormConfig::new(shape[1])
                        .with_epsilon(EPSILON)
                        .init::<Autodiff<B>>(device);
                    norm.gamma = Param::from_tensor(autodiff_leaf(&gamma));
                    norm.beta = Some(Param::from_tensor(autodiff_leaf(&beta)));
                    norm.forward(autodiff_leaf(&x))
                }
                false => {
                    let mut norm = RmsNormConfig::new(shape[1])
                        .with_epsilon(EPSILON)
                        .init::<Autodiff<B>>(device);
                    norm.gamma = Param::from_tensor(autodiff_leaf(&gamma));
                    norm.forward(autodiff_leaf(&x))
                }
            };
            let _ = (y * Tensor::from_inner(output_grad.clone()))
                .sum()
                .backward();
        },
    );
    let op = match centred {
        true => "layernorm fwd+bwd",
        false => "rmsnorm fwd+bwd",
    };
    record(op, format!("{shape:?}"), dtype, 0.0, times)
}

/// `t` on `Parallel<B>`.
fn decorated<B: Backend, const D: usize>(t: &Tensor<B, D>) -> Tensor<Parallel<B>, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t.clone().into_primitive().tensor()))
}

fn report(records: &[Record], json: bool) -> anyhow::Result<()> {
    if json {
        return print_json_lines(records);
    }
    println!(
        "{:<18} {:<30} {:>5} {:>10} {:>10} {:>9} {:>9} {:>8} {:>10}",
        "op",
        "shape",
        "dtype",
        "ours ms",
        "burn ms",
        "ours TF/s",
        "burn TF/s",
        "speedup",
        "difference"
    );
    // Elementwise records count no FLOPs.
    let tflops = |value: f64| match value {
        0.0 => "-".to_string(),
        value => format!("{value:.4}"),
    };
    for r in records {
        println!(
            "{:<18} {:<30} {:>5} {:>10.3} {:>10.3} {:>9} {:>9} {:>8.2} {:>10}",
            r.op,
            r.shape,
            r.dtype,
            r.ours_ms,
            r.burn_ms,
            tflops(r.ours_tflops),
            tflops(r.burn_tflops),
            r.speedup,
            r.difference.map_or("-".to_string(), |d| format!("{d:.1e}"))
        );
    }
    Ok(())
}

/// The GPU targets: attention forward+backward ≥ 400 TFLOP/s (causal, as trained), and
/// the matmul ≥ 70% of the dense peak.
fn check_targets(
    records: &[Record],
    dtype: FloatDType,
    peak_tflops: Option<f64>,
) -> anyhow::Result<()> {
    let peak = peak_tflops.context("--targets needs --peak-tflops for the matmul target")?;
    let find = |op: &str, causal: &str| {
        records
            .iter()
            .find(|r| r.op == op && r.shape.contains(causal))
            .expect("measured above")
    };
    let mut misses = Vec::new();
    let tolerance = difference_tolerance(dtype);
    for r in records {
        if let Some(difference) = r.difference.filter(|d| d.is_nan() || *d > tolerance) {
            misses.push(format!(
                "{} {}: differs from Burn's by {difference:.1e} > {tolerance:.0e}",
                r.op, r.shape
            ));
        }
    }
    let attention = find("attention fwd+bwd", "causal true");
    if attention.ours_tflops < 400.0 {
        misses.push(format!(
            "attention fwd+bwd {:.1} TFLOP/s < 400",
            attention.ours_tflops
        ));
    }
    let matmul = find("matmul", "");
    if matmul.ours_tflops < 0.7 * peak {
        misses.push(format!(
            "matmul {:.1} TFLOP/s < 70% of {peak} ({:.1})",
            matmul.ours_tflops,
            0.7 * peak
        ));
    }
    for miss in &misses {
        println!("TARGET MISSED: {miss}");
    }
    if !misses.is_empty() {
        bail!("{} kernel checks missed", misses.len());
    }
    println!("kernel targets met");
    Ok(())
}

/// How far ours may be from Burn's (relative to Burn's largest value): a few units of roundoff of
/// `dtype`, whose rounding Burn's own attention and matmul apply to their intermediates too.
fn difference_tolerance(dtype: FloatDType) -> f64 {
    match dtype {
        FloatDType::F16 => 8.0 * 2f64.powi(-11),
        FloatDType::BF16 => 8.0 * 2f64.powi(-8),
        _ => 1e-5,
    }
}
