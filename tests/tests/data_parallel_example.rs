//! A Burn user's model (`wildfire_examples::mlp`) on burn-train's `SupervisedTraining` under
//! the `DataParallel` strategy: 2 ranks (threads, and processes under `wildfire launch`) equal
//! one rank on the concatenated batches, every ZeRO stage equals DDP, replicas start identical
//! whatever each rank drew, and burn-train's checkpoints resume.
//!
//! Tolerance: a 2-rank step sums two batch-mean gradients and divides by 2, where one rank
//! takes the mean over the concatenated batch: the same terms summed in another order, so
//! losses and parameters agree within 1e-6 relative, not bitwise (on every SIMD width). ZeRO 1
//! and 2 own the same elements, so a ZeRO 1 checkpoint resumed under ZeRO 2 is held to the same
//! bound; a resume under the stage that saved it is bitwise.

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use wildfire_backend::Parallel;
use wildfire_backend::comm::{CommOptions, ProcessGroup};
use wildfire_examples::mlp::{FEATURES, Mlp, Outcome, Run, train};
use wildfire_parallel::fsdp::ZeroStage;
use wildfire_parallel::replicas::{ReplicaError, broadcast_parameters, verify_replicas};
use wildfire_parallel::{DataParallel, Mesh, ParallelDims};
use wildfire_tests::{launch, run_with_limit};

type B = Autodiff<Parallel<Flex>>;

const RANKS: usize = 2;
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
    train::<B>(DataParallel::new(mesh), &run)
}

/// `RANKS` thread ranks under `zero`; `tweak` adjusts each rank's run. Each rank's outcome.
fn threads(
    zero: ZeroStage,
    dir: &Path,
    tweak: impl Fn(Run) -> Run + Clone + Send + 'static,
) -> Vec<Outcome> {
    let _one = one_world();
    let meshes = Mesh::local(ParallelDims::data(RANKS, zero), options()).unwrap();
    let handles: Vec<_> = meshes
        .into_iter()
        .map(|mesh| {
            let run = tweak.clone()(run(dir, RANKS, 1, mesh.world().rank()));
            std::thread::spawn(move || train::<B>(DataParallel::new(mesh), &run))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
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

#[test]
fn two_thread_ranks_train_like_one_rank_under_every_stage() {
    let expected = serial(&scratch("serial"), 1);
    assert_eq!(expected.losses.len(), STEPS);
    assert!(
        expected.losses[STEPS - 1] < expected.losses[0],
        "the serial run learns: {:?}",
        expected.losses
    );
    for zero in [ZeroStage::Zero0, ZeroStage::One, ZeroStage::Two] {
        let ranks = threads(zero, &scratch(&format!("threads-{}", zero.level())), |r| r);
        assert_equals_serial(&ranks, &expected, &format!("{zero} on 2 threads"));
    }
}

/// Under `wildfire launch` (`WILDFIRE_EXAMPLE_REPORT` set): one rank of the example, which
/// writes its outcome there. Run alone, it does nothing.
#[test]
fn example_rank_under_launch() {
    let Ok(report) = std::env::var("WILDFIRE_EXAMPLE_REPORT") else {
        return;
    };
    let zero = std::env::var("WILDFIRE_EXAMPLE_ZERO")
        .ok()
        .and_then(|z| z.parse().ok())
        .and_then(ZeroStage::from_level)
        .expect("WILDFIRE_EXAMPLE_ZERO");
    let strategy = DataParallel::from_env(ParallelDims::data(RANKS, zero)).unwrap();
    let rank = strategy.mesh().world().rank();
    let dir = PathBuf::from(&report).with_extension("run");
    let outcome = train::<B>(strategy, &run(&dir, RANKS, 1, rank));
    let path = format!("{report}.rank-{rank}.json");
    std::fs::write(path, serde_json::to_string(&outcome).unwrap()).unwrap();
}

#[test]
fn two_processes_train_like_one_rank() {
    let expected = serial(&scratch("serial-for-processes"), 1);
    let test_binary = std::env::current_exe().unwrap();
    for zero in [ZeroStage::Zero0, ZeroStage::Two] {
        let report = scratch(&format!("processes-{}", zero.level())).join("outcome");
        std::fs::create_dir_all(report.parent().unwrap()).unwrap();
        let mut command = launch(
            RANKS,
            &[],
            &[
                test_binary.to_str().unwrap(),
                "data_parallel_example::example_rank_under_launch",
                "--exact",
                "--test-threads=1",
            ],
        );
        command
            .env("WILDFIRE_EXAMPLE_REPORT", &report)
            .env("WILDFIRE_EXAMPLE_ZERO", zero.level().to_string());
        let finished = run_with_limit(&mut command, Duration::from_secs(180));
        assert_eq!(finished.code, Some(0), "{}", finished.output());
        let ranks: Vec<Outcome> = (0..RANKS)
            .map(|rank| {
                let path = format!("{}.rank-{rank}.json", report.display());
                let text = std::fs::read_to_string(&path)
                    .unwrap_or_else(|e| panic!("{path}: {e}\n{}", finished.output()));
                serde_json::from_str(&text).unwrap()
            })
            .collect();
        assert_equals_serial(&ranks, &expected, &format!("{zero} on 2 processes"));
    }
}

#[test]
fn replicas_drawn_apart_are_named_then_broadcast() {
    let _one = one_world();
    let groups = ProcessGroup::local_world(RANKS, options()).unwrap();
    let handles: Vec<_> = groups
        .into_iter()
        .map(|group| {
            std::thread::spawn(move || {
                let device = Default::default();
                // Each rank draws its own parameters, and reads them only here (lazily).
                <B as Backend>::seed(&device, 5 + group.rank() as u64);
                let model = Mlp::<B>::new(&device, Default::default());
                let error = verify_replicas(&model, &group).unwrap_err();
                let model = broadcast_parameters(model, &group).unwrap();
                verify_replicas(&model, &group).unwrap();
                (error, model.parameters())
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (error, _) in &results {
        let ReplicaError::Differs {
            path, rank, shape, ..
        } = error
        else {
            panic!("expected a differing parameter, got {error}");
        };
        assert_eq!((path.as_str(), *rank), ("hidden.weight", 1), "{error}");
        assert_eq!(shape, &[FEATURES, wildfire_examples::mlp::HIDDEN]);
        assert!(error.to_string().contains("`hidden.weight`"), "{error}");
    }
    assert_eq!(results[0].1, results[1].1);
}

#[test]
fn burn_train_checkpoints_resume_under_the_same_and_another_stage() {
    let straight_dir = scratch("resume-straight");
    let straight = threads(ZeroStage::One, &straight_dir, |r| Run { epochs: 2, ..r });
    let saved = scratch("resume-saved");
    threads(ZeroStage::One, &saved, |r| r);
    let resumed = threads(ZeroStage::One, &saved, |r| Run {
        epochs: 2,
        resume: Some(1),
        ..r
    });
    assert_eq!(
        resumed[0].parameters, straight[0].parameters,
        "ZeRO 1 resumed under ZeRO 1"
    );
    let other = threads(ZeroStage::Two, &saved, |r| Run {
        epochs: 2,
        resume: Some(1),
        ..r
    });
    assert_close(
        &other[0].parameters,
        &straight[0].parameters,
        "ZeRO 1 resumed under ZeRO 2",
    );
    assert_eq!(other[0].parameters, other[1].parameters);
}
