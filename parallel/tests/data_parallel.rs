//! DDP and ZeRO stages 1–3 on a toy two-layer model with uneven shapes (7×15, 15×3, 3), ranks
//! as threads: DDP equals serial training on the concatenated batch, every ZeRO stage equals
//! DDP, every rank's shard is the matching slice of the full parameter and gradient, and the
//! sharded gradient norm is the full one. Each collective fails after 30 s instead of hanging.
//! The bitwise comparisons run the same products of the same shapes on both sides and sum each
//! gradient element over ranks in rank order, so they hold on every SIMD width. On wgpu, the
//! AdamW kernel steps ZeRO 1's flat slices as it steps DDP's whole tensors, bit for bit.

use std::collections::HashMap;
use wildfire_backend::compare::relative_difference;

use crate::common::{assert_close, threads, values};
use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, AdamWConfig, GradientsParams, Optimizer, SimpleOptimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use wildfire_backend::comm::{HostTensor, ProcessGroup, ReduceOp, split_ranges};
use wildfire_backend::device::FusedWgpu;
use wildfire_backend::kernels::adamw::FusedAdamW;
use wildfire_backend::kernels::probe;
use wildfire_backend::kernels::route::{KernelPath, kernel_paths};
use wildfire_parallel::device_value::read_value;
use wildfire_parallel::dp::{self, FlatLayout, ParamSpec};
use wildfire_parallel::fsdp::{Placeholders, ZeroOptimizer, ZeroStage, run_sharded_step};
use wildfire_parallel::learner_update::LearnerUpdate;
use wildfire_parallel::pp::PipelineChunk;
use wildfire_parallel::update::{StepOptions, Update, UpdateGroups};
use wildfire_parallel::{Mesh, ParallelDims};

/// The autodiff backend over `I`: Flex unless a test names another.
type A<I = Flex> = Autodiff<I>;

const ROWS: usize = 8;
const STEPS: usize = 10;
const LR: f64 = 1e-2;

/// `y = tanh(x W₁) W₂ + b` with `W₁: 7×15`, `W₂: 15×3`, `b: 3`.
#[derive(Module, Debug)]
struct Toy<B: Backend> {
    w1: Param<Tensor<B, 2>>,
    w2: Param<Tensor<B, 2>>,
    b: Param<Tensor<B, 1>>,
}

/// One layer of the toy as an FSDP unit: the first reads the batch, the second scores it.
#[derive(Module, Debug)]
struct Unit<B: Backend> {
    w: Param<Tensor<B, 2>>,
    b: Option<Param<Tensor<B, 1>>>,
}

/// Inputs `[1, rows, 7]`, targets `[1, rows, 3]`, second inputs `[1, rows, 15]` (the linear
/// loss), and `1 / rows of the global batch`.
#[derive(Debug, Clone)]
struct Batch<B: Backend> {
    x: Tensor<B, 3>,
    t: Tensor<B, 3>,
    u: Tensor<B, 3>,
    scale: f64,
}

fn tensor<B: Backend, const D: usize>(data: Vec<f32>, shape: [usize; D]) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(data, shape), &Default::default())
}

fn toy<I: Backend>(integer: bool) -> Toy<A<I>> {
    // Fixed ids, so runs compare parameter by parameter.
    let param = |seed: u64, shape: [usize; 2]| {
        let values = tensor(values(seed, shape[0] * shape[1], integer), shape);
        Param::initialized(ParamId::from(seed), values.require_grad())
    };
    Toy {
        w1: param(1, [7, 15]),
        w2: param(2, [15, 3]),
        b: Param::initialized(
            ParamId::from(3),
            tensor(values(3, 3, integer), [3]).require_grad(),
        ),
    }
}

/// Step `step`'s global batch, rows `rows` of it.
fn batch<I: Backend>(step: usize, rows: std::ops::Range<usize>, integer: bool) -> Batch<A<I>> {
    let x = values(100 + step as u64, ROWS * 7, integer);
    let t = values(200 + step as u64, ROWS * 3, integer);
    let u = values(300 + step as u64, ROWS * 15, integer);
    let n = rows.len();
    Batch {
        x: tensor(x[rows.start * 7..rows.end * 7].to_vec(), [1, n, 7]),
        t: tensor(t[rows.start * 3..rows.end * 3].to_vec(), [1, n, 3]),
        u: tensor(u[rows.start * 15..rows.end * 15].to_vec(), [1, n, 15]),
        scale: 1.0 / ROWS as f64,
    }
}

/// The toy's loss: `scale · Σ (y − t)²`; or, linear, `scale · (Σ x W₁ + Σ (u W₂ + b))`, whose
/// gradients are column sums of integer data, so every sum is exact (`scale` is 1/8).
fn toy_loss<I: Backend>(model: &Toy<A<I>>, batch: &Batch<A<I>>, linear: bool) -> Tensor<A<I>, 1> {
    let first = batch.x.clone().matmul(model.w1.val().unsqueeze());
    let loss = if linear {
        let second = batch.u.clone().matmul(model.w2.val().unsqueeze()) + model.b.val().unsqueeze();
        first.sum() + second.sum()
    } else {
        let y = first.tanh().matmul(model.w2.val().unsqueeze()) + model.b.val().unsqueeze();
        (y - batch.t.clone()).square().sum()
    };
    loss.mul_scalar(batch.scale)
}

impl<B: Backend> PipelineChunk<B> for Unit<B> {
    type Batch = Batch<B>;

    fn forward(&self, input: Option<Tensor<B, 3>>, batch: &Batch<B>) -> Tensor<B, 3> {
        match (input, &self.b) {
            (None, _) => batch.x.clone().matmul(self.w.val().unsqueeze()).tanh(),
            (Some(x), Some(b)) => x.matmul(self.w.val().unsqueeze()) + b.val().unsqueeze(),
            (Some(x), None) => x,
        }
    }

    fn loss(&self, output: Tensor<B, 3>, batch: &Batch<B>) -> (Tensor<B, 1>, Tensor<B, 1>) {
        let sum = (output - batch.t.clone()).square().sum();
        (sum.clone().mul_scalar(batch.scale), sum)
    }
}

/// Burn's AdamW for matrices (decay 0.1) and for vectors (none): the serial and DDP side.
fn adamw() -> (AdamW, AdamW) {
    let config = AdamWConfig::new().with_beta_2(0.99);
    (
        config.clone().with_weight_decay(0.1).build(),
        config.with_weight_decay(0.0).build(),
    )
}

/// The same settings as [`adamw`] in the fused step ZeRO runs, which must match Burn's bit for
/// bit for the sharded runs to equal the serial one.
fn fused_adamw() -> (FusedAdamW, FusedAdamW) {
    let matrices = FusedAdamW::new(0.9, 0.99, 1e-5, 0.1);
    let vectors = matrices.with_weight_decay(0.0);
    (matrices, vectors)
}

/// A per-tensor optimizer `O` for the matrices and one for the vectors (the serial and DDP
/// side): Burn's AdamW ([`adamw`]), or the fused one stepping each tensor ([`fused_adamw`]).
type PerTensor<O, I> = (
    OptimizerAdaptor<O, Toy<A<I>>, A<I>>,
    OptimizerAdaptor<O, Toy<A<I>>, A<I>>,
);

fn per_tensor<O: SimpleOptimizer<I>, I: Backend>(optimizers: (O, O)) -> PerTensor<O, I> {
    (optimizers.0.into(), optimizers.1.into())
}

fn per_tensor_step<O: SimpleOptimizer<I>, I: Backend>(
    model: Toy<A<I>>,
    grads: GradientsParams,
    optimizers: &mut PerTensor<O, I>,
) -> Toy<A<I>> {
    let mut grads = grads;
    let mut vector = GradientsParams::new();
    if let Some(grad) = grads.remove::<I, 1>(model.b.id) {
        vector.register(model.b.id, grad);
    }
    let model = optimizers.0.step(LR, model, grads);
    optimizers.1.step(LR, model, vector)
}

fn flat_values<I: Backend, M: AutodiffModule<A<I>>>(module: &M) -> HashMap<ParamId, Vec<f32>> {
    dp::flat_params(module)
        .into_iter()
        .map(|(id, t)| (id, t.into_data().to_vec().unwrap()))
        .collect()
}

fn grads_of<I: Backend>(model: &Toy<A<I>>, batch: &Batch<A<I>>, linear: bool) -> GradientsParams {
    GradientsParams::from_grads(toy_loss(model, batch, linear).backward(), model)
}

/// Serial training on the whole batch with Burn's AdamW: every parameter after each step.
fn serial(linear: bool) -> Vec<HashMap<ParamId, Vec<f32>>> {
    let mut optimizers = per_tensor(adamw());
    let mut model = toy::<Flex>(linear);
    (0..STEPS)
        .map(|step| {
            let grads = grads_of(&model, &batch(step, 0..ROWS, linear), linear);
            model = per_tensor_step(model.clone(), grads, &mut optimizers);
            flat_values(&model)
        })
        .collect()
}

fn rows_of(rank: usize, ranks: usize) -> std::ops::Range<usize> {
    let per = ROWS / ranks;
    rank * per..(rank + 1) * per
}

/// `steps` of DDP on `I` with the per-tensor `optimizers`: each rank its rows, gradients summed
/// in buckets; every rank's parameters after each step.
fn ddp<I: Backend, O: SimpleOptimizer<I> + 'static>(
    ranks: usize,
    linear: bool,
    steps: usize,
    optimizers: fn() -> (O, O),
) -> Vec<Vec<HashMap<ParamId, Vec<f32>>>> {
    threads(ranks, move |group| {
        let mut optimizers = per_tensor(optimizers());
        let mut model = toy::<I>(linear);
        let layout = FlatLayout::of_module(&model, 64);
        let rows = rows_of(group.rank(), ranks);
        (0..steps)
            .map(|step| {
                let _lock = wildfire_parallel::pp::graphs_lock();
                let grads = grads_of(&model, &batch(step, rows.clone(), linear), linear);
                drop(_lock);
                let (grads, stats) =
                    dp::all_reduce_gradients(&group, &layout, &model, grads, &Default::default())
                        .unwrap();
                assert_eq!(stats.buckets, layout.buckets.len());
                let _lock = wildfire_parallel::pp::graphs_lock();
                model = per_tensor_step(model.clone(), grads, &mut optimizers);
                flat_values(&model)
            })
            .collect()
    })
}

#[test]
fn ddp_equals_serial_training_on_the_concatenated_batch() {
    for linear in [true, false] {
        let reference = serial(linear);
        for ranks in [2, 4] {
            for (rank, steps) in ddp::<Flex, _>(ranks, linear, STEPS, adamw)
                .into_iter()
                .enumerate()
            {
                for (step, (params, expected)) in steps.iter().zip(&reference).enumerate() {
                    for (id, values) in params {
                        let what = format!("dp {ranks} rank {rank} step {step} {id}");
                        if linear {
                            // Integer data: every partial sum is exact, so bitwise.
                            assert_eq!(values, &expected[id], "{what}");
                        } else {
                            // The batch's gradient is summed in another order.
                            assert_close(values, &expected[id], 1e-6, &what);
                        }
                    }
                }
            }
        }
    }
}

/// What one rank of a ZeRO run saw: the parameters after each step; at the last step, the
/// owned part of each bucket's gradient with its range, and the squared norm of the gradient
/// (owned parts summed over ranks).
struct ZeroRun {
    params: Vec<HashMap<ParamId, Vec<f32>>>,
    owned_grads: Vec<(std::ops::Range<usize>, Vec<f32>)>,
    norm_squared: f64,
}

/// One rank of `steps` of ZeRO `stage` on `I` with the fused AdamW, the toy on its rows of
/// every global batch.
fn zero_run<I: Backend>(
    group: ProcessGroup,
    stage: ZeroStage,
    offload: bool,
    steps: usize,
) -> ZeroRun {
    let ranks = group.size();
    let rows = rows_of(group.rank(), ranks);
    let mut model = toy::<I>(false);
    // Stage 3 runs the model as two units: W₁, then W₂ and b.
    let units = [
        Unit {
            w: model.w1.clone(),
            b: None,
        },
        Unit {
            w: model.w2.clone(),
            b: Some(model.b.clone()),
        },
    ];
    let specs: Vec<ParamSpec> = [
        (model.w1.id, vec![7, 15], 0),
        (model.w2.id, vec![15, 3], 1),
        (model.b.id, vec![3], 1),
    ]
    .into_iter()
    .map(|(id, shape, unit)| ParamSpec {
        id,
        shape,
        unit,
        alone: false,
    })
    .collect();
    let layout = FlatLayout::new(&specs, 64);
    let mut zero = ZeroOptimizer::<I>::new(
        stage,
        group.clone(),
        layout,
        fused_adamw(),
        offload,
        Default::default(),
    );
    zero.set_params(&dp::flat_params(&model));
    let skeletons: Vec<Unit<A<I>>> = units
        .into_iter()
        .map(|u| {
            u.map(&mut Placeholders {
                device: Default::default(),
            })
        })
        .collect();
    let mut run = ZeroRun {
        params: Vec::new(),
        owned_grads: Vec::new(),
        norm_squared: 0.0,
    };
    for step in 0..steps {
        let batch = batch(step, rows.clone(), false);
        let mut grads = if stage == ZeroStage::ShardParameters {
            let step =
                run_sharded_step::<A<I>, _>(&zero, &skeletons, std::slice::from_ref(&batch), None)
                    .unwrap();
            // One unit whole at a time: the larger is W₁'s 7 × 15.
            assert_eq!(step.peak_gathered, 105);
            step.grads
        } else {
            let _lock = wildfire_parallel::pp::graphs_lock();
            let local = grads_of(&model, &batch, false);
            drop(_lock);
            zero.reduce(&model, local).unwrap().0
        };
        if step == steps - 1 {
            run.owned_grads = owned_parts(&zero, &grads);
            let squares = read_value(zero.shard_sum_of_squares(&grads, &[]));
            run.norm_squared = match stage {
                ZeroStage::Replicated => squares,
                _ => {
                    group
                        .all_reduce_host(HostTensor::new(vec![squares], vec![1]), ReduceOp::Sum)
                        .unwrap()
                        .data[0]
                }
            };
        }
        let updated = zero.step(LR, &dp::flat_params(&model), &mut grads).unwrap();
        if stage == ZeroStage::ShardParameters {
            let mut values = HashMap::new();
            for unit in 0..2 {
                values.extend(zero.gather_unit(unit).unwrap());
            }
            run.params.push(
                values
                    .into_iter()
                    .map(|(id, t)| (id, t.into_data().to_vec().unwrap()))
                    .collect(),
            );
        } else {
            let _lock = wildfire_parallel::pp::graphs_lock();
            model = model.map(&mut dp::SetParams(&updated));
            run.params.push(flat_values(&model));
        }
    }
    run
}

fn owned_parts<I: Backend>(
    zero: &ZeroOptimizer<I>,
    grads: &GradientsParams,
) -> Vec<(std::ops::Range<usize>, Vec<f32>)> {
    let (rank, ranks) = (zero.group().rank(), zero.group().size());
    zero.layout()
        .buckets
        .iter()
        .map(|bucket| {
            let range = match zero.stage() {
                ZeroStage::Replicated => 0..bucket.numel,
                _ => split_ranges(bucket.numel, ranks)[rank].clone(),
            };
            let part = grads
                .get::<I, 1>(bucket.id)
                .unwrap()
                .into_data()
                .to_vec()
                .unwrap();
            (range, part)
        })
        .collect()
}

#[test]
fn flat_adamw_replicated_equals_burns_per_tensor_ddp_bitwise() {
    let flat = threads(2, |group| {
        zero_run::<Flex>(group, ZeroStage::Replicated, false, STEPS)
    });
    let burn = ddp::<Flex, _>(2, false, STEPS, adamw);
    for (rank, (flat, burn)) in flat.iter().zip(&burn).enumerate() {
        for (step, (a, b)) in flat.params.iter().zip(burn).enumerate() {
            assert_eq!(a, b, "rank {rank} step {step}");
        }
    }
}

#[test]
fn every_zero_stage_equals_ddp_and_owns_slices_of_the_full_gradient() {
    for ranks in [2, 4] {
        let reference = threads(ranks, |group| {
            zero_run::<Flex>(group, ZeroStage::Replicated, false, STEPS)
        });
        for (stage, offload) in [
            (ZeroStage::ShardOptimizer, false),
            (ZeroStage::ShardGradients, false),
            (ZeroStage::ShardParameters, false),
            (ZeroStage::ShardOptimizer, true),
            (ZeroStage::ShardParameters, true),
        ] {
            let runs = threads(ranks, move |group| {
                zero_run::<Flex>(group, stage, offload, STEPS)
            });
            for (rank, (run, expected)) in runs.iter().zip(&reference).enumerate() {
                let what = format!("{stage} offload {offload} on {ranks} ranks, rank {rank}");
                // Same reduction order (sums in rank order), same elementwise AdamW: bitwise.
                for (step, (params, expected)) in
                    run.params.iter().zip(&expected.params).enumerate()
                {
                    assert_eq!(params, expected, "{what}, parameters after step {step}");
                }
                for ((range, part), (_, full)) in run.owned_grads.iter().zip(&expected.owned_grads)
                {
                    assert_eq!(
                        part.as_slice(),
                        &full[range.clone()],
                        "{what}, owned gradient"
                    );
                }
                // Each owned part is summed in f32 by the backend: another order than the whole.
                let relative =
                    (run.norm_squared - expected.norm_squared).abs() / expected.norm_squared;
                assert!(
                    relative < 1e-6,
                    "{what}: norm² {} vs {}",
                    run.norm_squared,
                    expected.norm_squared
                );
            }
        }
    }
}

/// The steps of the fused-AdamW comparison: the count Burn's AdamW is matched over in the
/// kernel's own test (wildfire-backend's tests/adamw.rs).
const FUSED_STEPS: usize = 50;

/// The calls of the AdamW kernel queued in Burn's fusion stream so far in this process.
fn fused_stream_adamw_calls() -> u64 {
    (kernel_paths().into_iter())
        .filter(|&(op, path, _)| op == "adamw" && path == KernelPath::CubeClFused)
        .map(|(_, _, count)| count)
        .sum()
}

/// On wgpu as `--device wgpu` trains (Burn's fusion over CubeCL), 50 steps at dp 2: ZeRO 1
/// steps each rank's slice of each flat bucket with one launch of the AdamW kernel, DDP steps
/// each whole tensor with one launch, and the two are equal bit for bit (the kernel runs the
/// same f32 operations on each element wherever the slice starts; the gradients are summed in
/// rank order in both). Both follow DDP with Burn's op-by-op AdamW within the kernel test's
/// bound, 1e-5 of each tensor's largest magnitude (lavapipe: the same bits). On the CPU,
/// Flex's pass equals Burn's bitwise (the tests above).
#[test]
fn on_wgpu_zero1_with_the_adamw_kernel_equals_ddp_with_it() {
    if probe::for_test(probe::wgpu(), "WILDFIRE_REQUIRE_WGPU").is_none() {
        return;
    }
    let run = |stage| {
        threads(2, move |group| {
            zero_run::<FusedWgpu>(group, stage, false, FUSED_STEPS)
        })
    };
    // This is the one test of this binary on wgpu, so the kernel's count is its own.
    let before = fused_stream_adamw_calls();
    let zero1 = run(ZeroStage::ShardOptimizer);
    let zero1_calls = fused_stream_adamw_calls() - before;
    let fused = ddp::<FusedWgpu, _>(2, false, FUSED_STEPS, fused_adamw);
    let ddp_calls = fused_stream_adamw_calls() - before - zero1_calls;
    let burn = ddp::<FusedWgpu, _>(2, false, FUSED_STEPS, adamw);

    // Every step after the first (which creates the moments with Burn's step): one launch per
    // owned slice on each rank, one per tensor (three) on each rank.
    let slices: usize = (zero1.iter())
        .map(|rank| {
            rank.owned_grads
                .iter()
                .filter(|(r, _)| !r.is_empty())
                .count()
        })
        .sum();
    let later_steps = (FUSED_STEPS - 1) as u64;
    assert_eq!(
        zero1_calls,
        later_steps * slices as u64,
        "ZeRO 1's launches"
    );
    assert_eq!(ddp_calls, later_steps * 2 * 3, "DDP's launches");

    let mut worst = 0f32;
    for (rank, ((zero1, fused), burn)) in zero1.iter().zip(&fused).zip(&burn).enumerate() {
        assert_eq!(zero1.params.len(), FUSED_STEPS);
        for (step, ((zero1, fused), burn)) in zero1.params.iter().zip(fused).zip(burn).enumerate() {
            assert_eq!(zero1, fused, "rank {rank} step {step}: ZeRO 1 against DDP");
            for (id, values) in fused {
                let what = format!("rank {rank} step {step} {id}: the kernel against Burn's");
                assert_close(values, &burn[id], 1e-5, &what);
                worst = worst.max(relative_difference(values, &burn[id]) as f32);
            }
        }
    }
    println!("the AdamW kernel against Burn's over {FUSED_STEPS} steps: {worst:.1e} at worst");
}

/// Three DDP steps at dp 2 with clipping and a loss scale, through `Update::update` directly
/// and through the Learner's optimizer (`LearnerUpdate`, stepped as burn-train's Learner steps
/// it): the parameters after each step and the reported norms, per rank.
fn learner_update_run(group: ProcessGroup, through_learner: bool) -> Vec<(Vec<f32>, f64)> {
    let mesh = Mesh::new(group, ParallelDims::data(2, ZeroStage::Replicated)).unwrap();
    let mut model = toy::<Flex>(false);
    let optimizer = OptimizerAdaptor::from(adamw().0);
    let update = Update::replicated(optimizer, FlatLayout::of_module(&model, 64));
    let (max_norm, loss_scale) = (0.5, 4.0);
    let mut learner = LearnerUpdate::new(update, UpdateGroups::from(&mesh), max_norm, vec![]);
    learner.set_loss_scale(Some(loss_scale));
    let rows = rows_of(mesh.data().rank(), 2);
    (0..3)
        .map(|step| {
            let _lock = wildfire_parallel::pp::graphs_lock();
            let batch = Batch {
                scale: loss_scale / ROWS as f64,
                ..batch(step, rows.clone(), false)
            };
            let grads = grads_of(&model, &batch, false);
            drop(_lock);
            let norm = if through_learner {
                model = learner.step(LR, model.clone(), grads);
                let stats = learner.take_stats().unwrap();
                assert!(!stats.skipped);
                read_value(stats.grad_norm)
            } else {
                let options = StepOptions {
                    loss_scale,
                    skip_overflow: true,
                    ..StepOptions::new(LR, max_norm)
                };
                let groups = UpdateGroups::from(&mesh);
                let (updated, stats) = (learner.update())
                    .update(groups, model.clone(), grads, options)
                    .unwrap();
                model = updated;
                assert!(!stats.skipped);
                read_value(stats.grad_norm)
            };
            let mut by_id: Vec<_> = flat_values(&model).into_iter().collect();
            by_id.sort_by_key(|(id, _)| id.val());
            let values = by_id.into_iter().flat_map(|(_, v)| v).collect();
            (values, norm)
        })
        .collect()
}

#[test]
fn the_learners_optimizer_steps_as_the_update_it_holds() {
    let direct = threads(2, |group| learner_update_run(group, false));
    let learner = threads(2, |group| learner_update_run(group, true));
    assert_eq!(learner, direct, "parameters and norms, rank by rank");
    // The clipping bound binds: the norm reported is the unscaled one, above 0.5.
    assert!(direct[0].iter().all(|(_, norm)| *norm > 0.5), "{direct:?}");
    // A step that failed, or none at all, is reported as an error, not as stats.
    let error = threads(1, |group| {
        let mesh = Mesh::new(group, ParallelDims::data(1, ZeroStage::Replicated)).unwrap();
        let model = toy::<Flex>(false);
        let optimizer: OptimizerAdaptor<AdamW, Toy<A>, A> = OptimizerAdaptor::from(adamw().0);
        let update = Update::<A, _>::replicated(optimizer, FlatLayout::of_module(&model, 64));
        let learner = LearnerUpdate::new(update, UpdateGroups::from(&mesh), 0.0, vec![]);
        learner.take_stats().unwrap_err().to_string()
    });
    assert_eq!(error[0], "the Learner ran no optimizer step to report on");
}
