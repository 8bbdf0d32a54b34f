//! The CubeCL FlashAttention-2 kernels (`kernels::attention::cube`) on wgpu (Mesa's lavapipe on CI), and
//! on CUDA too in a `--features cuda` build (`scripts/gpu-check.sh`): forward and all three
//! input gradients against decomposed attention with autodiff on Flex in f32, from the same
//! (rounded) inputs, causal and not, at the tile edges ([`CASES`]). In f16 the cases are those of
//! one head dim ([`HALF_CASES`]), in bf16 all of them. The native loops on Flex
//! (`kernels::attention::flex`) run every head dim with both masks in f32, and are checked to
//! read strided heads as they lie.
//!
//! Lavapipe ends an invocation's loops after 65535 iterations in all (see
//! `kernels::route::LOOP_ITERATION_CAP`); before the kernels unrolled their loops over a row's
//! columns, head dim 128 at length 257 passed it and gave wrong gradients. Length 600 at head
//! dim 128 (past it before, for the forward too) has its own test, as has the kernels' declining
//! a shape still past it where the wgpu device may be lavapipe.
//!
//! Tolerances, on `max |kernel − reference| / max |reference|` per tensor:
//! - **f32**: 1e-5. Both compute in f32; they differ only in summation order.
//! - **f16**: 4u = 2e-3 with u = 2^-11 (f16's unit roundoff). The kernel computes in f32 and
//!   rounds once to f16 on output, an error of u relative to each element.
//! - **bf16**: 4u = 1.6e-2 with u = 2^-8. Vulkan has no bf16 arithmetic, so on lavapipe this
//!   case reports itself skipped; `scripts/gpu-check.sh` runs it on CUDA.
//!
//! Without a device a backend's cases report themselves skipped, unless `WILDFIRE_REQUIRE_WGPU=1`
//! (set by `.ci/run`) or `WILDFIRE_REQUIRE_CUDA=1` (set by `scripts/gpu-check.sh`) makes that a
//! failure.

use burn::backend::{Autodiff, Flex, Wgpu};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Distribution, FloatDType, Shape, Tensor, TensorData, TensorPrimitive};
use cubecl::wgpu::WgpuRuntime;
use wildfire_backend::Parallel;
use wildfire_backend::kernels::attention::{cube, flex};
use wildfire_backend::kernels::attention::{decomposed_attention, fused_attention};
use wildfire_backend::kernels::cube_kernel::TensorSpec;
use wildfire_backend::kernels::route::{cube_runtime, kernels_enabled, loops_capped};

use crate::common::{KernelBackend, has_dtype, output_and_grads, relative_error};

type Reference = Autodiff<Flex>;

/// What a kernel under test computes from `[query, key, value, output gradient]` (primitives in
/// the case's dtype) and the mask: `[output, dQ, dK, dV]`.
type Run<B> = fn([FloatTensor<B>; 4], bool) -> [FloatTensor<B>; 4];

/// The CubeCL kernels ([`cube::forward`], [`cube::backward`]).
fn cube_kernels<B: KernelBackend>(
    inputs: [FloatTensor<B>; 4],
    causal: bool,
) -> [FloatTensor<B>; 4] {
    let [query, key, value, output_grad] = inputs;
    let (output, logsumexp) = cube::forward(query.clone(), key.clone(), value.clone(), causal);
    let saved = [query, key, value, output.clone(), logsumexp, output_grad];
    let [query_grad, key_grad, value_grad] = cube::backward(saved, causal);
    [output, query_grad, key_grad, value_grad]
}

/// The native loops on Flex ([`flex::attention_forward`], [`flex::attention_backward`]), which
/// must take f32 inputs.
fn flex_loops(inputs: [FloatTensor<Flex>; 4], causal: bool) -> [FloatTensor<Flex>; 4] {
    let [query, key, value, output_grad] = inputs;
    let [output, logsumexp] =
        flex::attention_forward([query.clone(), key.clone(), value.clone()], causal)
            .expect("the forward takes f32");
    let saved = [query, key, value, output.clone(), logsumexp, output_grad];
    let [query_grad, key_grad, value_grad] =
        flex::attention_backward(saved, causal).expect("the backward takes f32");
    [output, query_grad, key_grad, value_grad]
}

/// One case: the relative errors of `run`'s output, dQ, dK and dV against decomposed attention.
fn errors<B: Backend>(
    device: &B::Device,
    dtype: DType,
    (seq, d_head, causal): (usize, usize, bool),
    run: Run<B>,
) -> [f32; 4] {
    let shape = [1, 2, seq, d_head];
    let draw = |seed: u64| {
        Flex::seed(&Default::default(), seed);
        Tensor::<Flex, 4>::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
            .into_data()
            .convert_dtype(dtype)
    };
    let data: Vec<TensorData> = (0..4)
        .map(|i| draw(seq as u64 * 1000 + d_head as u64 + i))
        .collect();

    // Built in f32 and cast: `from_data` gives the backend's default float type.
    let primitive = |data: &TensorData| {
        Tensor::<B, 4>::from_data(data.clone(), device)
            .cast(FloatDType::from(dtype))
            .into_primitive()
            .tensor()
    };
    let read = |tensor: FloatTensor<B>| {
        Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(tensor)).into_data()
    };
    let kernel = run([0, 1, 2, 3].map(|i| primitive(&data[i])), causal).map(read);

    let reference = output_and_grads::<Reference>(&data, &Default::default(), |q, k, v| {
        decomposed_attention(q, k, v, causal)
    });
    let mut errors = [0.0; 4];
    for (error, (actual, expected)) in errors.iter_mut().zip(kernel.into_iter().zip(reference)) {
        *error = relative_error(actual, expected);
    }
    errors
}

/// A head dim, the lengths to run at it, and the masks (causal or not) to run each with.
type Case = (usize, &'static [usize], &'static [bool]);

/// Every length and mask of each case in `dtype` with `run` on backend `B`, each within
/// `tolerance`.
fn check_on<B: Backend>(
    device: &B::Device,
    dtype: DType,
    tolerance: f32,
    cases: &[Case],
    run: Run<B>,
) {
    let backend = B::name(device);
    let mut failures = Vec::new();
    for &(d_head, lengths, masks) in cases {
        for &seq in lengths {
            for &causal in masks {
                let start = std::time::Instant::now();
                let errors = errors::<B>(device, dtype, (seq, d_head, causal), run);
                let case = format!(
                    "d_head {d_head} seq {seq} causal {causal}: O, dQ, dK, dV {}",
                    errors.map(|error| format!("{error:.1e}")).join(" ")
                );
                let seconds = start.elapsed().as_secs_f64();
                println!("{backend} {dtype:?} {case} ({seconds:.1} s)");
                if !errors.iter().all(|error| *error <= tolerance) {
                    failures.push(case);
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{backend} {dtype:?} beyond {tolerance:e}: {failures:?}"
    );
}

/// [`check_on`] with the CubeCL kernels on kernel backend `B`, where it has a device that
/// computes in `dtype`.
fn check<B: KernelBackend>(dtype: DType, tolerance: f32, cases: &[Case]) {
    let Some(device) = B::test_device() else {
        return;
    };
    if has_dtype::<B>(&device, dtype) {
        check_on::<B>(&device, dtype, tolerance, cases, cube_kernels::<B>);
    }
}

/// The kernels' tile edges at head dims of one, two (48: the second part-filled, its padding
/// columns zero) and four 32-column steps: one row, part of a tile (17), whole tiles (64, two
/// of `TILE` = 32 rows) and a part past whole ones (65). Longer sequences add only more whole
/// tiles, at quadratic cost on lavapipe. Both masks at 48 and 128; head dim 32 only causal, as
/// the models run: on lavapipe each head dim and mask is a set of shaders to compile per type
/// (20–50 s each on a 2-vCPU Xeon, most of the test's time), and the mask is the same code at
/// every head dim.
const CASES: [Case; 3] = [
    (32, TILE_EDGES, &[true]),
    (48, TILE_EDGES, &[true, false]),
    (128, TILE_EDGES, &[true, false]),
];

/// The lengths at the tile edges (see [`CASES`]).
const TILE_EDGES: &[usize] = &[1, 17, 64, 65];

/// Every head dim of [`CASES`] with both masks: for the native loops on Flex, where a case costs
/// no compiling.
const EVERY_MASK: [Case; 3] = [
    (32, TILE_EDGES, &[true, false]),
    (48, TILE_EDGES, &[true, false]),
    (128, TILE_EDGES, &[true, false]),
];

/// The half-type cases: causal at head dim 48, the part-filled step. A half type changes only
/// how the kernels load and store (they compute in f32 and round on output), the same code at
/// every head dim and mask. bf16 runs only on CUDA, where compiling costs little, so it keeps
/// every case of [`CASES`].
const HALF_CASES: [Case; 1] = [(48, TILE_EDGES, &[true])];

#[test]
fn wgpu_tensors_route_to_the_cubecl_kernels_unless_opted_out() {
    assert_eq!(cube_runtime::<FloatTensor<Parallel<Wgpu>>>(), Some("wgpu"));
    assert_eq!(cube_runtime::<FloatTensor<Parallel<Flex>>>(), None);
    assert_eq!(
        kernels_enabled(),
        std::env::var("WILDFIRE_KERNELS").map_or(true, |v| v == "cubecl")
    );
}

#[test]
fn f32_kernels_match_decomposed_attention() {
    on_kernel_backends!(check(DType::F32, 1e-5, &CASES));
}

#[test]
fn f16_kernels_match_decomposed_attention() {
    on_kernel_backends!(check(DType::F16, 4.0 * 2f32.powi(-11), &HALF_CASES));
}

#[test]
fn bf16_kernels_match_decomposed_attention() {
    on_kernel_backends!(check(DType::BF16, 4.0 * 2f32.powi(-8), &CASES));
}

/// The native loops on Flex, f32 only (half types run the reference, tested in
/// `kernels::attention`): every head dim with both masks, and length 600 at head dim 128.
#[test]
fn flex_loops_match_decomposed_attention() {
    let device = Default::default();
    check_on::<Flex>(&device, DType::F32, 1e-5, &EVERY_MASK, flex_loops);
    check_on::<Flex>(&device, DType::F32, 1e-5, &LENGTH_600, flex_loops);
}

/// The loops read heads where they lie: on a strided view (the GPT's heads, `[batch, seq,
/// heads, d]` with the middle dims swapped) they give the same bits as on a contiguous copy,
/// and they decline half types (the reference runs those).
#[test]
fn flex_loops_read_strided_heads_and_decline_half_types() {
    let device = Default::default();
    let draw = |seed: u64| {
        Flex::seed(&device, seed);
        Tensor::<Flex, 4>::random([2, 45, 3, 32], Distribution::Normal(0.0, 1.0), &device)
            .swap_dims(1, 2)
    };
    let views = [1, 2, 3, 4].map(draw);
    let copies = views
        .clone()
        .map(|view| Tensor::<Flex, 4>::from_data(view.into_data(), &device));
    let read = |tensors: [FloatTensor<Flex>; 4]| {
        tensors.map(|t| Tensor::<Flex, 4>::from_primitive(TensorPrimitive::Float(t)).into_data())
    };
    let primitives = |tensors: [Tensor<Flex, 4>; 4]| tensors.map(|t| t.into_primitive().tensor());
    for causal in [true, false] {
        let strided = read(flex_loops(primitives(views.clone()), causal));
        let contiguous = read(flex_loops(primitives(copies.clone()), causal));
        for (name, (a, b)) in ["O", "dQ", "dK", "dV"]
            .iter()
            .zip(strided.iter().zip(&contiguous))
        {
            assert_eq!(
                a, b,
                "{name}, causal {causal}: strided heads give other bits"
            );
        }
    }
    for dtype in [FloatDType::F16, FloatDType::BF16] {
        let [q, k, v, _] = primitives(views.clone().map(|t| t.cast(dtype)));
        assert!(
            flex::attention_forward([q, k, v], true).is_none(),
            "{dtype:?}"
        );
    }
}

/// `Parallel<Flex>` sends fused attention in f32 to the native loops: the op's output is
/// theirs, bit for bit (the reference sums in another order).
#[test]
fn parallel_flex_routes_f32_attention_to_the_loops() {
    if !kernels_enabled() {
        eprintln!("skipped: WILDFIRE_KERNELS=reference routes everything to the reference");
        return;
    }
    let device = Default::default();
    Flex::seed(&device, 5);
    let draw =
        || Tensor::<Flex, 4>::random([1, 2, 70, 32], Distribution::Normal(0.0, 1.0), &device);
    let [q, k, v] = [draw(), draw(), draw()];
    let decorated = |t: &Tensor<Flex, 4>| {
        Tensor::<Parallel<Flex>, 4>::from_primitive(TensorPrimitive::Float(
            t.clone().into_primitive().tensor(),
        ))
    };
    let routed = fused_attention(decorated(&q), decorated(&k), decorated(&v), true).into_data();
    let primitive = |t: Tensor<Flex, 4>| t.into_primitive().tensor();
    let [loops, _] = flex::attention_forward([q, k, v].map(primitive), true).expect("f32");
    let loops = Tensor::<Flex, 4>::from_primitive(TensorPrimitive::Float(loops)).into_data();
    assert_eq!(routed, loops);
}

/// Length 600 at head dim 128, both masks.
const LENGTH_600: [Case; 1] = [(128, &[600], &[true, false])];

/// Length 600 at head dim 128: past lavapipe's loop cap before the loops over a row's columns
/// were unrolled (the forward was wrong too); now well inside it.
#[test]
fn head_dim_128_length_600() {
    on_kernel_backends!(check(DType::F32, 1e-5, &LENGTH_600));
}

/// Where the wgpu device may be Mesa's lavapipe (it is installed, so wgpu's default device may
/// be it), the kernels decline a shape whose loops would pass its cap, naming the shape, and the
/// reference runs instead; on a machine without lavapipe they take the shape.
#[test]
fn shapes_past_the_loop_cap_are_declined_where_lavapipe_may_run() {
    let Some(device) = Wgpu::test_device() else {
        return;
    };
    let lavapipe_installed = ["/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d"]
        .iter()
        .filter_map(|dir| std::fs::read_dir(dir).ok())
        .flatten()
        .any(|entry| entry.is_ok_and(|e| e.file_name().to_string_lossy().starts_with("lvp_icd")));
    assert_eq!(
        loops_capped::<WgpuRuntime>(&device),
        lavapipe_installed,
        "loop cap on {device:?}, with lavapipe installed: {lavapipe_installed}"
    );
    let (seq, d_head) = (7000, 100);
    let query = TensorSpec::new(Shape::new([1, 1, seq, d_head]), DType::F32);
    let declined =
        cube::unsupported::<WgpuRuntime>(&[query.clone(), query.clone(), query], &device);
    match declined {
        Some(reason) => assert!(
            lavapipe_installed
                && reason.contains("length 7000")
                && reason.contains("head dim 100")
                && reason.contains("65535"),
            "{reason}"
        ),
        None => assert!(!lavapipe_installed, "a shape past lavapipe's cap was taken"),
    }
}

/// Grouped-query attention (`kv_heads` of 1, 2 and 4 shared by 4 query heads) through
/// `Autodiff<Parallel<B>>` in `dtype`: against attention on the key/value heads repeated in
/// the graph (whose backward sums the repetitions' gradients), the relative errors of the
/// output and of dQ, dK and dV, each case printed.
fn grouped_against_repeated<B: Backend>(device: &B::Device, dtype: FloatDType) -> Vec<[f32; 4]> {
    type P<B> = Autodiff<Parallel<B>>;
    let (heads, seq, d_head) = (4, 37, 16);
    let draw = |heads: usize, seed: u64| {
        Flex::seed(&Default::default(), seed);
        let data = Tensor::<Flex, 4>::random(
            [2, heads, seq, d_head],
            Distribution::Normal(0.0, 1.0),
            &Default::default(),
        )
        .into_data();
        Tensor::<P<B>, 4>::from_data(data, device).cast(dtype)
    };
    let read = |t: Tensor<P<B>, 4>| t.cast(FloatDType::F32).into_data();
    [1, 2, 4]
        .into_iter()
        .map(|kv_heads| {
            let (q, k, v) = (draw(heads, 1), draw(kv_heads, 2), draw(kv_heads, 3));
            let output_grad = draw(heads, 4);
            let run = |repeat: bool| {
                let (q, k, v) = (q.clone(), k.clone(), v.clone());
                let [q, k, v] = [q, k, v].map(Tensor::require_grad);
                let repeated = |kv: &Tensor<P<B>, 4>| match repeat {
                    true => kv
                        .clone()
                        .unsqueeze_dim::<5>(2)
                        .expand([2, kv_heads, heads / kv_heads, seq, d_head])
                        .reshape([2, heads, seq, d_head]),
                    false => kv.clone(),
                };
                let output = fused_attention(q.clone(), repeated(&k), repeated(&v), true);
                let grads = (output.clone() * output_grad.clone()).sum().backward();
                let grad = |t: &Tensor<P<B>, 4>| Tensor::from_inner(t.grad(&grads).unwrap());
                [read(output), read(grad(&q)), read(grad(&k)), read(grad(&v))]
            };
            let (grouped, repeated) = (run(false), run(true));
            let errors =
                [0, 1, 2, 3].map(|i| relative_error(grouped[i].clone(), repeated[i].clone()));
            println!(
                "{} {dtype:?} kv_heads {kv_heads}: O, dQ, dK, dV {}",
                B::name(device),
                errors.map(|e| format!("{e:.1e}")).join(" ")
            );
            errors
        })
        .collect()
}

/// Grouped key/value heads give what repeating them for their query heads gives. On Flex in
/// f32 the native loops read the shared heads where they lie: the output and dQ are the same
/// arithmetic per query head (bitwise), and dK, dV sum the group's contributions in one
/// accumulator where the repeated form sums each repetition's total, so they differ by f32
/// summation order (1e-5, as the kernels' f32 bound). In f16 (Flex's reference) and on wgpu
/// (the CubeCL kernels) the heads are repeated before the kernel and its gradients summed back:
/// the output and dQ are the repeated form's bits, dK and dV within the same bound (f16:
/// the sums of at most 4 rounded terms, 4u).
#[test]
fn grouped_query_attention_equals_attention_on_repeated_heads() {
    let exact_o_and_dq = |errors: &[[f32; 4]], bound: f32, what: &str| {
        for e in errors {
            assert!(e[0] == 0.0 && e[1] == 0.0, "{what}: O, dQ differ: {e:?}");
            assert!(
                e[2] <= bound && e[3] <= bound,
                "{what}: dK, dV beyond {bound:e}: {e:?}"
            );
        }
    };
    let flex = Default::default();
    exact_o_and_dq(
        &grouped_against_repeated::<Flex>(&flex, FloatDType::F32),
        1e-5,
        "flex f32",
    );
    let f16 = grouped_against_repeated::<Flex>(&flex, FloatDType::F16);
    exact_o_and_dq(&f16, 4.0 * 2f32.powi(-11), "flex f16");
    if let Some(device) = Wgpu::test_device() {
        exact_o_and_dq(
            &grouped_against_repeated::<Wgpu>(&device, FloatDType::F32),
            1e-5,
            "wgpu",
        );
    }
}
