//! wildfire on Burn's fusion backend (`FusedWgpu`, what `--device wgpu` trains on): every fused
//! op queues its CubeCL kernel in the fusion stream and gives what the same kernel gives on the
//! bare backend; a call a kernel declines runs the reference, counted and never silently; and a
//! fused tensor resolves to its CubeCL tensor and back, as the NCCL path does on CUDA.

use burn::backend::{Autodiff, Wgpu};
use burn::tensor::backend::{AutodiffBackend, Backend, BackendTypes};
use burn::tensor::{FloatDType, Tensor, TensorData, TensorPrimitive};
use cubecl::wgpu::WgpuRuntime;
use wildfire_backend::device::FusedWgpu;
use wildfire_backend::kernels::attention::{fused_attention, fused_qkv_attention};
use wildfire_backend::kernels::bias_gelu::bias_gelu;
use wildfire_backend::kernels::layer_norm::{layer_norm, rms_norm};
use wildfire_backend::kernels::matmul::{MixedMatmul, mixed_matmul};
use wildfire_backend::kernels::rope::rope;
use wildfire_backend::kernels::route::{KernelPath, kernel_paths, set_kernels_enabled};
use wildfire_backend::kernels::swiglu::swiglu;
use wildfire_backend::{DecoratedBackend, Parallel, fusion};

use crate::common::{KernelBackend, alone_in_a_process, signed_values, tensor_of};

/// A decorated backend with autodiff, as models train on.
type Tracked<B> = Autodiff<Parallel<B>>;

/// The ops whose CubeCL kernels [`every_op`] runs, as the router counts them.
const KERNEL_OPS: [&str; 12] = [
    "attention forward",
    "attention backward",
    "bias_gelu forward",
    "bias_gelu backward",
    "layer_norm forward",
    "layer_norm backward",
    "rms_norm forward",
    "rms_norm backward",
    "rope",
    "swiglu forward",
    "swiglu backward",
    "mixed-precision matmul",
];

/// An input of `shape` with values in [−1, 1) from `seed`, tracked for its gradient.
fn input<A: AutodiffBackend, const D: usize>(
    shape: [usize; D],
    seed: u64,
    device: &A::Device,
) -> Tensor<A, D> {
    let count = shape.iter().product();
    tensor_of::<A, D>(&signed_values(count, seed, 1.0), shape, device).require_grad()
}

/// `Σ output ∘ w` for a fixed `w`: a loss whose gradient for the output is `w`.
fn weighted_sum<A: AutodiffBackend, const D: usize>(
    output: &Tensor<A, D>,
    seed: u64,
) -> Tensor<A, 1> {
    let shape = output.dims();
    let count = shape.iter().product();
    let weight = tensor_of::<A, D>(&signed_values(count, seed, 1.0), shape, &output.device());
    (output.clone() * weight).sum()
}

/// Each fused op's output and its inputs' gradients on backend `A`, in a fixed order: attention
/// (alike and grouped key/value heads, causal), attention on a packed QKV projection, bias +
/// GELU, LayerNorm, RMSNorm, the rotary embedding, SwiGLU; then the mixed-precision matmul with
/// bias and GELU (no gradient: it is a matmul policy of `Parallel<B>`, not an autodiff op).
fn every_op<A>(device: &A::Device) -> Vec<TensorData>
where
    A: AutodiffBackend + DecoratedBackend,
    A::InnerBackend: DecoratedBackend,
{
    let mut results = Vec::new();
    let mut keep = |output: TensorData, grads: Vec<TensorData>| {
        results.push(output);
        results.extend(grads);
    };
    let grad = |t: &Tensor<A, 4>, grads: &A::Gradients| t.grad(grads).unwrap().into_data();
    for kv_heads in [4, 2] {
        let q = input::<A, 4>([2, 4, 37, 16], 1, device);
        let [k, v] = [2, 3].map(|seed| input::<A, 4>([2, kv_heads, 37, 16], seed, device));
        let output = fused_attention(q.clone(), k.clone(), v.clone(), true);
        let grads = weighted_sum(&output, 4).backward();
        let input_grads = [&q, &k, &v].map(|t| grad(t, &grads)).to_vec();
        keep(output.into_data(), input_grads);
    }
    let qkv = input::<A, 4>([2, 37, 12, 16], 5, device);
    let output = fused_qkv_attention(qkv.clone(), true);
    let grads = weighted_sum(&output, 6).backward();
    keep(output.into_data(), vec![grad(&qkv, &grads)]);

    let x = input::<A, 3>([3, 5, 64], 7, device);
    let bias = input::<A, 1>([64], 8, device);
    let output = bias_gelu(x.clone(), bias.clone());
    let grads = weighted_sum(&output, 9).backward();
    let input_grads = vec![
        x.grad(&grads).unwrap().into_data(),
        bias.grad(&grads).unwrap().into_data(),
    ];
    keep(output.into_data(), input_grads);

    for centred in [true, false] {
        let x = input::<A, 2>([6, 96], 10, device);
        let [gamma, beta] = [11, 12].map(|seed| input::<A, 1>([96], seed, device));
        let output = match centred {
            true => layer_norm(x.clone(), gamma.clone(), Some(beta.clone()), 1e-5),
            false => rms_norm(x.clone(), gamma.clone(), 1e-5),
        };
        let grads = weighted_sum(&output, 13).backward();
        let mut input_grads = vec![x.grad(&grads).unwrap().into_data()];
        input_grads.push(gamma.grad(&grads).unwrap().into_data());
        if centred {
            input_grads.push(beta.grad(&grads).unwrap().into_data());
        }
        keep(output.into_data(), input_grads);
    }

    // Tables holding each row's angles in both halves, as `rope` requires.
    let (seq, width) = (7, 16);
    let angles: Vec<f32> = (0..seq * width)
        .map(|i| (i / width) as f32 * 0.1 * ((i % (width / 2)) as f32 + 1.0))
        .collect();
    let table = |f: fn(f32) -> f32| {
        let values: Vec<f32> = angles.iter().map(|&a| f(a)).collect();
        tensor_of::<A, 2>(&values, [seq, width], device)
    };
    let x = input::<A, 4>([2, seq, 3, width], 14, device);
    let output = rope(x.clone(), table(f32::cos), table(f32::sin));
    let grads = weighted_sum(&output, 15).backward();
    keep(output.into_data(), vec![grad(&x, &grads)]);

    let [gate, up] = [16, 17].map(|seed| input::<A, 2>([4, 48], seed, device));
    let output = swiglu(gate.clone(), up.clone());
    let grads = weighted_sum(&output, 18).backward();
    let input_grads = [&gate, &up]
        .map(|t| t.grad(&grads).unwrap().into_data())
        .to_vec();
    keep(output.into_data(), input_grads);

    let inner = |shape: &[usize], seed| {
        let count = shape.iter().product();
        TensorData::new(signed_values(count, seed, 1.0), shape.to_vec())
    };
    let [lhs, rhs] = [([2, 8, 32], 19), ([2, 32, 24], 20)]
        .map(|(shape, seed)| Tensor::<A::InnerBackend, 3>::from_data(inner(&shape, seed), device));
    let bias = Tensor::<A::InnerBackend, 1>::from_data(inner(&[24], 21), device);
    let spec = MixedMatmul {
        compute: FloatDType::F32,
        output: FloatDType::F32,
        gelu: true,
    };
    keep(
        mixed_matmul(lhs, rhs, Some(bias), spec).into_data(),
        Vec::new(),
    );
    results
}

/// The calls of `op` on `path` so far in this process.
fn calls(op: &str, path: KernelPath) -> u64 {
    kernel_paths()
        .into_iter()
        .filter(|&(name, taken, _)| name == op && taken == path)
        .map(|(_, _, count)| count)
        .sum()
}

/// Under fusion every fused op takes its CubeCL kernel, queued in the fusion stream, and gives
/// the bare backend's bits: the kernels are the same code on the same inputs, and what runs
/// around them (the weighted loss's gradient, repeating and summing grouped key/value heads in
/// pairs, packing the QKV gradient) rounds alike fused or not (products by the weights, sums of
/// two terms, copies). No call of these ops runs the reference. Alone in a process: it counts
/// the router's decisions.
#[test]
fn under_fusion_every_op_takes_its_kernel_in_the_fusion_stream() {
    if !alone_in_a_process("fusion::under_fusion_every_op_takes_its_kernel_in_the_fusion_stream") {
        return;
    }
    if let Some(device) = Wgpu::test_device() {
        fused_against_bare::<Wgpu, FusedWgpu>(&device, &device);
    }
}

/// The same on CUDA (`--features cuda`; `scripts/gpu-check.sh`).
#[cfg(feature = "cuda")]
#[test]
fn under_fusion_every_op_takes_its_kernel_in_the_fusion_stream_on_cuda() {
    let name = "fusion::under_fusion_every_op_takes_its_kernel_in_the_fusion_stream_on_cuda";
    if !alone_in_a_process(name) {
        return;
    }
    if let Some(device) = burn::backend::Cuda::test_device() {
        fused_against_bare::<burn::backend::Cuda, wildfire_backend::device::FusedCuda>(
            &device, &device,
        );
    }
}

/// See [`under_fusion_every_op_takes_its_kernel_in_the_fusion_stream`]: `Bare` is a CubeCL
/// backend, `Fused` the same under Burn's fusion. Then a head dim past the kernel's 256 is
/// declined before anything is queued, runs as the reference in Burn ops on the fused backend,
/// and is counted as such.
fn fused_against_bare<Bare, Fused>(
    bare_device: &<Tracked<Bare> as BackendTypes>::Device,
    device: &<Tracked<Fused> as BackendTypes>::Device,
) where
    Bare: Backend,
    Fused: Backend,
    Tracked<Bare>: DecoratedBackend,
    Parallel<Bare>: DecoratedBackend,
    Tracked<Fused>: DecoratedBackend,
    Parallel<Fused>: DecoratedBackend,
{
    set_kernels_enabled(true);
    let bare = every_op::<Tracked<Bare>>(bare_device);
    let fused = every_op::<Tracked<Fused>>(device);
    assert_eq!(bare.len(), fused.len());
    for (i, (bare, fused)) in bare.iter().zip(&fused).enumerate() {
        assert_eq!(bare.shape, fused.shape, "result {i}: shapes");
        let bits = |data: &TensorData| -> Vec<u32> {
            let values: Vec<f32> = data.clone().convert::<f32>().to_vec().unwrap();
            values.iter().map(|v| v.to_bits()).collect()
        };
        let (bare, fused) = (bits(bare), bits(fused));
        let differing = bare.iter().zip(&fused).filter(|(a, b)| a != b).count();
        assert_eq!(
            differing,
            0,
            "result {i}: {differing} of {} values differ",
            bare.len()
        );
    }
    let paths = kernel_paths();
    println!("kernel paths: {paths:?}");
    for op in KERNEL_OPS {
        assert!(
            calls(op, KernelPath::CubeCl) > 0,
            "{op} never launched bare: {paths:?}"
        );
        assert!(
            calls(op, KernelPath::CubeClFused) > 0,
            "{op} never queued in the fusion stream: {paths:?}"
        );
        assert_eq!(
            calls(op, KernelPath::Reference),
            0,
            "{op} ran the reference: {paths:?}"
        );
    }

    let [q, k, v] = [1, 2, 3].map(|seed| input::<Tracked<Fused>, 4>([1, 1, 5, 300], seed, device));
    let output = fused_attention(q, k, v, false).into_data();
    let values: Vec<f32> = output.convert::<f32>().to_vec().unwrap();
    assert!(values.iter().all(|v| v.is_finite()), "{values:?}");
    assert_eq!(
        calls("attention forward", KernelPath::Reference),
        1,
        "{:?}",
        kernel_paths()
    );
}

/// A fused tensor resolves to the CubeCL tensor its queue computes, and a CubeCL tensor enters
/// the fusion stream as a tensor later ops can use: what a collective does with a fused tensor
/// (small integers, so every value is exact).
#[test]
fn a_fused_tensor_resolves_to_its_buffer_and_back() {
    let Some(device) = Wgpu::test_device() else {
        return;
    };
    let values: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let a = tensor_of::<FusedWgpu, 2>(&values, [3, 4], &device);
    // Queued, not yet run: resolving runs the queue up to it.
    let queued = (a.clone() + a) * 2.0;
    let cube = fusion::resolve::<WgpuRuntime>(queued.into_primitive().tensor());
    let bare = Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(cube.clone()));
    let expected: Vec<f32> = values.iter().map(|v| 4.0 * v).collect();
    assert_eq!(bare.into_data().to_vec::<f32>().unwrap(), expected);
    let adopted =
        Tensor::<FusedWgpu, 2>::from_primitive(TensorPrimitive::Float(fusion::adopt(cube)));
    let later = (adopted + 1.0).into_data().to_vec::<f32>().unwrap();
    let expected: Vec<f32> = expected.iter().map(|v| v + 1.0).collect();
    assert_eq!(later, expected);
}
