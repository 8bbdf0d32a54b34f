//! A Burn user's model (`wildfire_examples::mlp`) on burn-train's `SupervisedTraining` under
//! the `DataParallel` strategy: 2 ranks (threads, and processes under `wildfire launch`) equal
//! one rank on the concatenated batches, every ZeRO stage equals DDP, replicas start identical
//! whatever each rank drew, burn-train's checkpoints resume under every stage, and ZeRO 3 saves
//! memory (as processes; thread ranks keep its units whole between steps).
//!
//! Tolerance: a 2-rank step sums two batch-mean gradients and divides by 2, where one rank
//! takes the mean over the concatenated batch: the same terms summed in another order, so
//! losses and parameters agree within 1e-6 relative, not bitwise (on every SIMD width), and the
//! logged gradient norms within 1e-5. A checkpoint resumed under another stage holds the same
//! moments cut differently and is held to the same 1e-6 bound; a resume under the stage that
//! saved it is bitwise.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use wildfire_backend::Parallel;
use wildfire_backend::comm::{CommOptions, ProcessGroup, run_threads_within};
use wildfire_backend::kernels::adamw::FusedAdamW;
use wildfire_examples::mlp::{FEATURES, Mlp, Outcome, Run, Shape, StepLog, train};
use wildfire_parallel::fsdp::ZeroStage;
use wildfire_parallel::replicas::{ReplicaError, broadcast_parameters, verify_replicas};
use wildfire_parallel::{DataParallel, Mesh, ParallelDims};
use wildfire_tests::{launch_test_ranks, launched_var, rank_reports, run_with_limit};

use crate::HEAP;

/// ZeRO 3 needs the checkpointing that gathers a unit's parameters again going back; it
/// recomputes exactly, so the other stages run on it too.
type B = Autodiff<Parallel<Flex>, BalancedCheckpointing>;

const RANKS: usize = 2;
/// How long a world of thread ranks may run before the test fails, naming the ranks left.
const LIMIT: Duration = Duration::from_secs(300);
const BATCH: usize = 8;
const STEPS: usize = 10;

/// One thread world of these tests at a time: thread ranks share Burn's autodiff registry, and
/// burn-train loads a checkpoint's parameters (new graph leaves) outside any lock of ours.
static ONE_WORLD: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_world() -> std::sync::MutexGuard<'static, ()> {
    ONE_WORLD.lock().unwrap_or_else(|p| p.into_inner())
}

fn options() -> CommOptions {
    CommOptions {
        timeout: Duration::from_secs(60),
        debug: true,
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("wildfire-dp-example-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A run of `STEPS` steps per epoch of `ranks` ranks' batches of `BATCH`.
fn run(dir: &Path, ranks: usize, epochs: usize, rank: usize) -> Run {
    Run {
        dir: dir.to_path_buf(),
        batch: BATCH,
        points: RANKS * BATCH * STEPS,
        epochs,
        resume: None,
        seed: 1000 + rank as u64,
        lr: 1e-2,
        serial_for_ranks: (ranks == 1).then_some(RANKS),
        shape: Shape::default(),
        log: StepLog::default(),
    }
}

/// One rank's run on the concatenated batches of `RANKS` ranks.
fn serial(dir: &Path, epochs: usize) -> Outcome {
    let _one = one_world();
    let mesh = Mesh::local(ParallelDims::default(), options())
        .unwrap()
        .remove(0);
    let run = Run {
        batch: RANKS * BATCH,
        ..run(dir, 1, epochs, 0)
    };
    train::<B>(DataParallel::new(mesh), &run).unwrap()
}

/// `RANKS` thread ranks under `zero`; `tweak` adjusts each rank's run. Each rank's outcome.
fn threads(
    zero: ZeroStage,
    dir: &Path,
    tweak: impl Fn(Run) -> Run + Clone + Send + 'static,
) -> Vec<Outcome> {
    threads_with(zero, dir, |strategy| strategy, tweak)
}

/// [`threads`] with each rank's strategy made by `strategy`.
fn threads_with(
    zero: ZeroStage,
    dir: &Path,
    strategy: impl Fn(DataParallel) -> DataParallel,
    tweak: impl Fn(Run) -> Run + Clone + Send + 'static,
) -> Vec<Outcome> {
    let _one = one_world();
    let meshes = Mesh::local(ParallelDims::data(RANKS, zero), options()).unwrap();
    let jobs: Vec<_> = meshes
        .into_iter()
        .map(|mesh| {
            let run = tweak.clone()(run(dir, RANKS, 1, mesh.world().rank()));
            let strategy = strategy(DataParallel::new(mesh));
            move || train::<B>(strategy, &run).unwrap()
        })
        .collect();
    run_threads_within(jobs, LIMIT)
}

/// Within `1e-6 × max|expected|`, element by element.
fn assert_close(actual: &[f32], expected: &[f32], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths");
    let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            (a - e).abs() <= 1e-6 * scale,
            "{what}[{i}]: {a} vs {e} (bound 1e-6 × {scale})"
        );
    }
}

/// The global batch's loss of each step: the mean of the ranks' batch means (equal batches).
fn global_losses(ranks: &[Outcome]) -> Vec<f32> {
    (0..ranks[0].losses.len())
        .map(|k| ranks.iter().map(|r| r.losses[k]).sum::<f32>() / ranks.len() as f32)
        .collect()
}

/// Every rank holds the same parameters, and the run equals `expected` (losses and
/// parameters).
fn assert_equals_serial(ranks: &[Outcome], expected: &Outcome, what: &str) {
    for rank in &ranks[1..] {
        assert_eq!(
            rank.parameters, ranks[0].parameters,
            "{what}: replicas differ"
        );
    }
    assert_eq!(ranks[0].losses.len(), STEPS, "{what}: steps");
    assert_close(
        &global_losses(ranks),
        &expected.losses,
        &format!("{what}: losses"),
    );
    assert_close(
        &ranks[0].parameters,
        &expected.parameters,
        &format!("{what}: parameters"),
    );
}

/// The gradient norms that rank 0 (its artifact directory `dir`) logged through
/// `DataParallel::grad_norm_metric` in the first epoch, one per step.
fn logged_grad_norms(dir: &Path) -> Vec<f64> {
    let path = dir.join("train/epoch-1/Gradient_Norm.log");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("the gradient-norm metric's log {}: {e}", path.display()));
    // burn-train logs a numeric entry as `value,count`.
    let value = |line: &str| line.split(',').next().unwrap_or_default().parse::<f64>();
    (text.lines())
        .map(|line| value(line).unwrap_or_else(|e| panic!("{}: {line:?}: {e}", path.display())))
        .collect()
}

/// One finite, positive norm per step, each within `1e-5 × expected` (the norm of gradients
/// that agree within 1e-6 relative, summed in f64).
fn assert_grad_norms_close(actual: &[f64], expected: &[f64], what: &str) {
    assert_eq!(actual.len(), STEPS, "{what}: gradient norms {actual:?}");
    for (step, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            a.is_finite() && *a > 0.0 && (a - e).abs() <= 1e-5 * e,
            "{what}: step {step}'s gradient norm {a} vs {e} (bound 1e-5 relative)"
        );
    }
}

#[test]
fn two_thread_ranks_train_like_one_rank_under_every_stage() {
    let serial_dir = scratch("serial");
    let expected = serial(&serial_dir, 1);
    let expected_norms = logged_grad_norms(&serial_dir);
    assert_eq!(expected.losses.len(), STEPS);
    assert!(
        expected.losses[STEPS - 1] < expected.losses[0],
        "the serial run learns: {:?}",
        expected.losses
    );
    for zero in [
        ZeroStage::Replicated,
        ZeroStage::ShardOptimizer,
        ZeroStage::ShardGradients,
        ZeroStage::ShardParameters,
    ] {
        let dir = scratch(&format!("threads-{}", zero.level()));
        let ranks = threads(zero, &dir, |r| r);
        let what = format!("{zero} on 2 threads");
        assert_equals_serial(&ranks, &expected, &what);
        assert_grad_norms_close(&logged_grad_norms(&dir), &expected_norms, &what);
    }
}

#[test]
fn offloaded_moments_train_bitwise_like_moments_on_the_device() {
    for zero in [
        ZeroStage::Replicated,
        ZeroStage::ShardGradients,
        ZeroStage::ShardParameters,
    ] {
        let level = zero.level();
        let on_device = threads(zero, &scratch(&format!("device-{level}")), |r| r);
        let offloaded = threads_with(
            zero,
            &scratch(&format!("offloaded-{level}")),
            |strategy| strategy.with_offload(true),
            |r| r,
        );
        for (offloaded, on_device) in offloaded.iter().zip(&on_device) {
            assert_eq!(
                offloaded.losses, on_device.losses,
                "{zero} offloaded: losses"
            );
            assert_eq!(
                offloaded.parameters, on_device.parameters,
                "{zero} offloaded: parameters"
            );
        }
    }
}

/// A run of the example as `RANKS` processes under `wildfire launch`, each running
/// [`example_rank_under_launch`] of this test binary.
#[derive(Debug, Clone)]
struct Processes {
    zero: ZeroStage,
    /// burn-train's artifact directory (shared by a run and its resumption).
    dir: PathBuf,
    epochs: usize,
    resume: Option<usize>,
    /// The large shape, and each rank's heap peak per step.
    memory: bool,
}

/// What one process rank reports.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct RankReport {
    outcome: Outcome,
    /// The most heap bytes live during a training step after the first (forward, backward and
    /// optimizer update), above what was live before the model was built.
    step_peak_bytes: Option<usize>,
}

impl Processes {
    fn new(zero: ZeroStage, dir: &Path) -> Self {
        Self {
            zero,
            dir: dir.to_path_buf(),
            epochs: 1,
            resume: None,
            memory: false,
        }
    }

    fn run(&self, name: &str) -> Vec<RankReport> {
        let report = self.dir.join(format!("{name}.report"));
        std::fs::create_dir_all(&self.dir).unwrap();
        let mut command =
            launch_test_ranks(RANKS, "data_parallel_example::example_rank_under_launch");
        command
            .env("WILDFIRE_EXAMPLE_REPORT", &report)
            .env("WILDFIRE_EXAMPLE_DIR", &self.dir)
            .env("WILDFIRE_EXAMPLE_ZERO", self.zero.level().to_string())
            .env("WILDFIRE_EXAMPLE_EPOCHS", self.epochs.to_string());
        if let Some(epoch) = self.resume {
            command.env("WILDFIRE_EXAMPLE_RESUME", epoch.to_string());
        }
        if self.memory {
            command.env("WILDFIRE_EXAMPLE_MEMORY", "1");
        }
        let finished = run_with_limit(&mut command, Duration::from_secs(240));
        assert_eq!(finished.code, Some(0), "{name}: {}", finished.output());
        rank_reports(&report, RANKS, &finished)
    }
}

/// The memory runs' model: eight 512 × 512 hidden blocks hold 97% of its 2.1 M parameters.
const LARGE: Shape = Shape {
    width: 512,
    blocks: 8,
};

/// Under `wildfire launch` (`WILDFIRE_EXAMPLE_REPORT` set): one rank of a [`Processes`] run,
/// which writes its [`RankReport`].
#[test]
#[ignore = "a rank of the jobs Processes::run launches"]
fn example_rank_under_launch() {
    let report = launched_var("WILDFIRE_EXAMPLE_REPORT");
    let var = |name: &str| std::env::var(format!("WILDFIRE_EXAMPLE_{name}")).ok();
    let number = |name: &str| var(name).map(|v| v.parse::<usize>().expect(name));
    let zero = number("ZERO")
        .and_then(|z| ZeroStage::from_level(z as u8))
        .expect("WILDFIRE_EXAMPLE_ZERO");
    let strategy = DataParallel::from_env(ParallelDims::data(RANKS, zero)).unwrap();
    let rank = strategy.mesh().world().rank();
    let mut run = run(Path::new(&var("DIR").expect("DIR")), RANKS, 1, rank);
    run.epochs = number("EPOCHS").unwrap_or(1);
    run.resume = number("RESUME");
    let step_peaks = Arc::new(Mutex::new(Vec::new()));
    let baseline = var("MEMORY").map(|_| {
        run.shape = LARGE;
        HEAP.enable();
        let peaks = step_peaks.clone();
        // As each step starts: the peak of the window that ends here (the step before, from
        // its forward to its optimizer update), and a new window.
        run.log = StepLog::probed(move || {
            peaks.lock().unwrap().push(HEAP.window_peak());
            HEAP.start_window();
        });
        HEAP.current()
    });
    let outcome = train::<B>(strategy, &run).unwrap();
    let step_peak_bytes = baseline.map(|baseline| {
        let peaks = step_peaks.lock().unwrap();
        // Window 0 is the start. Window 1, the first step, also frees one (DDP) or two (ZeRO 3)
        // models' worth of memory that the start left live: as many as the parameter sets it
        // replaced (drawn, broadcast). Where they were held until then is not pinned down; the
        // steady steps follow.
        peaks[2..].iter().max().expect("three steps or more") - baseline
    });
    let path = format!("{report}.rank-{rank}.json");
    let report = RankReport {
        outcome,
        step_peak_bytes,
    };
    std::fs::write(path, serde_json::to_string(&report).unwrap()).unwrap();
}

fn outcomes(reports: Vec<RankReport>) -> Vec<Outcome> {
    reports.into_iter().map(|r| r.outcome).collect()
}

#[test]
fn two_processes_train_like_one_rank_under_every_stage() {
    let serial_dir = scratch("serial-for-processes");
    let expected = serial(&serial_dir, 1);
    let expected_norms = logged_grad_norms(&serial_dir);
    for zero in [
        ZeroStage::Replicated,
        ZeroStage::ShardGradients,
        ZeroStage::ShardParameters,
    ] {
        let dir = scratch(&format!("processes-{}", zero.level()));
        let ranks = outcomes(Processes::new(zero, &dir).run("train"));
        let what = format!("{zero} on 2 processes");
        assert_equals_serial(&ranks, &expected, &what);
        assert_grad_norms_close(&logged_grad_norms(&dir), &expected_norms, &what);
    }
}

/// `saved`'s first-epoch checkpoint resumed for a second epoch under `zero` (2 processes).
fn resumed_under(zero: ZeroStage, saved: &Path, name: &str) -> Vec<Outcome> {
    let resumed = Processes {
        epochs: 2,
        resume: Some(1),
        ..Processes::new(zero, saved)
    };
    let ranks = outcomes(resumed.run(name));
    assert_eq!(ranks[0].parameters, ranks[1].parameters, "{name}: replicas");
    ranks
}

#[test]
fn zero_3_checkpoints_resume_bitwise_and_other_stages_resume_them_closely() {
    let saved = scratch("zero-3-saved");
    Processes::new(ZeroStage::ShardParameters, &saved).run("first-epoch");
    let straight = outcomes(
        Processes {
            epochs: 2,
            ..Processes::new(ZeroStage::ShardParameters, &scratch("zero-3-straight"))
        }
        .run("straight"),
    );
    let resumed = resumed_under(ZeroStage::ShardParameters, &saved, "zero-3-under-zero-3");
    assert_eq!(resumed[0].parameters, straight[0].parameters);
    let ddp = resumed_under(ZeroStage::Replicated, &saved, "zero-3-under-ddp");
    assert_close(
        &ddp[0].parameters,
        &straight[0].parameters,
        "ZeRO 3 resumed under DDP",
    );
    // And the other way: a DDP checkpoint (thread ranks save the same files) under ZeRO 3.
    let ddp_saved = scratch("ddp-saved-for-zero-3");
    threads(ZeroStage::Replicated, &ddp_saved, |r| r);
    let zero_3 = resumed_under(ZeroStage::ShardParameters, &ddp_saved, "ddp-under-zero-3");
    assert_close(
        &zero_3[0].parameters,
        &straight[0].parameters,
        "DDP resumed under ZeRO 3",
    );
}

/// The bound: ZeRO 3 holds half of each unit's parameters, gradients and moments on each of
/// two ranks, plus one block whole at a time; DDP holds all of it. Measured 2026-12-02 on a
/// 2-vCPU AMD EPYC (AVX2): see docs/benchmarks/memory.md.
const ZERO_3_PEAK_BOUND: f64 = 0.6;

#[test]
fn zero_3_peak_step_memory_is_at_most_six_tenths_of_ddp() {
    let peaks = |zero: ZeroStage| -> Vec<usize> {
        let run = Processes {
            memory: true,
            ..Processes::new(zero, &scratch(&format!("memory-{}", zero.level())))
        };
        let reports = run.run("memory");
        reports.iter().map(|r| r.step_peak_bytes.unwrap()).collect()
    };
    let ddp = peaks(ZeroStage::Replicated);
    let zero_3 = peaks(ZeroStage::ShardParameters);
    for rank in 0..RANKS {
        let ratio = zero_3[rank] as f64 / ddp[rank] as f64;
        println!(
            "rank {rank}: step peak ZeRO 3 {} B, DDP {} B, ratio {ratio:.3}",
            zero_3[rank], ddp[rank]
        );
        assert!(
            ratio <= ZERO_3_PEAK_BOUND,
            "rank {rank}: ZeRO 3's step peak {} B is {ratio:.3} × DDP's {} B (bound \
             {ZERO_3_PEAK_BOUND})",
            zero_3[rank],
            ddp[rank]
        );
    }
}

#[test]
fn zero_3_refuses_models_without_units_and_kept_gathers() {
    let _one = one_world();
    let adamw = || FusedAdamW::new(0.9, 0.999, 1e-8, 0.0);
    let device = Default::default();
    let model = Mlp::<B>::new(&device, Shape::default(), StepLog::default());
    let one = Mesh::local(ParallelDims::data(1, ZeroStage::ShardParameters), options()).unwrap();
    let one = DataParallel::new(one[0].clone());
    let no_units = Mlp::<B>::new(
        &device,
        Shape {
            width: 8,
            blocks: 0,
        },
        StepLog::default(),
    );
    let error = one.adamw(&no_units, adamw()).unwrap_err();
    assert!(error.to_string().contains("no ShardedUnit"), "{error}");
    let keeps = Mlp::<Autodiff<Parallel<Flex>>>::new(&device, Shape::default(), StepLog::default());
    let error = one.adamw(&keeps, adamw()).unwrap_err();
    assert!(
        error.to_string().contains("BalancedCheckpointing"),
        "{error}"
    );
    assert!(one.adamw(&model, adamw()).is_ok());
}

#[test]
fn replicas_drawn_apart_are_named_then_broadcast() {
    let _one = one_world();
    let groups = ProcessGroup::local_world(RANKS, options()).unwrap();
    let jobs: Vec<_> = groups
        .into_iter()
        .map(|group| {
            move || {
                let device = Default::default();
                // Each rank draws its own parameters, and reads them only here (lazily).
                <B as Backend>::seed(&device, 5 + group.rank() as u64);
                let model = Mlp::<B>::new(&device, Shape::default(), StepLog::default());
                let error = verify_replicas(&model, &group).unwrap_err();
                let model = broadcast_parameters(model, &group).unwrap();
                verify_replicas(&model, &group).unwrap();
                (error, model.parameters())
            }
        })
        .collect();
    let results = run_threads_within(jobs, LIMIT);
    for (error, _) in &results {
        let ReplicaError::Differs {
            path, rank, shape, ..
        } = error
        else {
            panic!("expected a differing parameter, got {error}");
        };
        assert_eq!((path.as_str(), *rank), ("input.weight", 1), "{error}");
        assert_eq!(shape, &[FEATURES, Shape::default().width]);
        assert!(error.to_string().contains("`input.weight`"), "{error}");
    }
    assert_eq!(results[0].1, results[1].1);
}

#[test]
fn burn_train_checkpoints_resume_bitwise_under_their_stage_and_closely_under_another() {
    let straight = threads(
        ZeroStage::ShardOptimizer,
        &scratch("resume-straight"),
        |r| Run { epochs: 2, ..r },
    );
    let second_epoch = |zero: ZeroStage, saved: &Path| {
        threads(zero, saved, |r| Run {
            epochs: 2,
            resume: Some(1),
            ..r
        })
    };
    let saved = scratch("resume-saved");
    threads(ZeroStage::ShardOptimizer, &saved, |r| r);
    assert_eq!(
        second_epoch(ZeroStage::ShardOptimizer, &saved)[0].parameters,
        straight[0].parameters,
        "ZeRO 1 resumed under ZeRO 1"
    );
    let ddp_saved = scratch("resume-ddp-saved");
    threads(ZeroStage::Replicated, &ddp_saved, |r| r);
    for (zero, saved, what) in [
        (
            ZeroStage::ShardGradients,
            &saved,
            "ZeRO 1 resumed under ZeRO 2",
        ),
        (ZeroStage::Replicated, &saved, "ZeRO 1 resumed under DDP"),
        (
            ZeroStage::ShardGradients,
            &ddp_saved,
            "DDP resumed under ZeRO 2",
        ),
    ] {
        let other = second_epoch(zero, saved);
        assert_close(&other[0].parameters, &straight[0].parameters, what);
        assert_eq!(other[0].parameters, other[1].parameters, "{what}: replicas");
    }
}
