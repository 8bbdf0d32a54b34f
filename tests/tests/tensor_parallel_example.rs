//! A Burn user's model split by its own tensor-parallel plan (`wildfire_examples::
//! tensor_parallel`: the MLP classifier, its first two hidden blocks a column-, row-parallel
//! pair), on 2 processes, against the same model unsplit (a group of one rank), with and
//! without sequence parallelism:
//! - the first step's logits and gradients, and 10 training steps' losses and parameters, agree
//!   within 1e-5 (relative to the largest value): the column-parallel block computes every
//!   output as the serial one does, the row-parallel block sums the ranks' partial products in
//!   another order than the serial dot product, a few ulps apart;
//! - a step issues the collectives the plan implies, counted on the group;
//! - a plan that does not fit the model is refused naming the path and sizes.

use std::path::Path;
use std::time::Duration;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use wildfire_backend::Parallel;
use wildfire_backend::comm::{OpKind, ProcessGroup, run_thread_ranks};
use wildfire_examples::mlp::{Mlp, Shape, StepLog};
use wildfire_examples::tensor_parallel::{self, TP_PLAN, build, plan};
use wildfire_parallel::tp::{PlanError, SequencePartial, TpPlan, TpStyle, apply_plan, check_plan};
use wildfire_parallel::{Mesh, ParallelDims};
use wildfire_tests::{
    example_loop_run as run, launch_test_ranks, launched_var, options, rank_reports,
    relative_difference, run_with_limit, widened,
};

type B = Autodiff<Parallel<Flex>>;
const LIMIT: Duration = Duration::from_secs(300);
/// Logits, gradients, losses and parameters against the serial model, relative to the largest
/// value. Measured (2026-12-07, AVX-512 Xeon): logits 7.5e-8, gradients 3.1e-8, losses 8.4e-8,
/// parameters after 10 steps 4.2e-7 apart at worst; the bound is about 24× the worst, the margin
/// for AdamW's amplification of rounding in small gradients (see recipes' `tensor_parallel`).
const TOLERANCE: f64 = 1e-5;

/// A group of one rank: the model unsplit.
fn solo() -> ProcessGroup {
    ProcessGroup::local_world(1, options(60.0, false))
        .expect("a one-rank world")
        .remove(0)
}

/// The model with each parameter's value replaced by its gradient (zeros where it has none):
/// gradients in the model's layout, which the plan then cuts as it cuts the parameters.
struct AsGradients<'a>(&'a GradientsParams);

impl<A: AutodiffBackend> ModuleMapper<A> for AsGradients<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<A, D>>) -> Param<Tensor<A, D>> {
        let id = param.id;
        param.map(|value| match self.0.get::<A::InnerBackend, D>(id) {
            Some(grad) => Tensor::from_inner(grad),
            None => value.zeros_like(),
        })
    }
}

/// `[all-gather, reduce-scatter, all-reduce]` issued on `group` so far.
fn counts(group: &ProcessGroup) -> [u64; 3] {
    [OpKind::AllGather, OpKind::ReduceScatter, OpKind::AllReduce].map(|op| group.op_count(op))
}

fn since(now: [u64; 3], before: [u64; 3]) -> [u64; 3] {
    std::array::from_fn(|i| now[i] - before[i])
}

/// What one process rank of a tensor-parallel run reports.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct RankReport {
    /// The first step's logits and this rank's gradients (in the model's parameter order).
    logits: Vec<f32>,
    gradients: Vec<f32>,
    /// `[AG, RS, AR]` issued by the first step's forward, backward and sequence-partial sum.
    collectives: [[u64; 3]; 3],
    /// Every step's loss, and this rank's part of the trained parameters.
    losses: Vec<f32>,
    parameters: Vec<f32>,
}

/// The first step on this rank of `group`: logits, gradients and the collectives of each part.
fn first_step(sp: bool, group: &ProcessGroup) -> (Vec<f32>, Vec<f32>, [[u64; 3]; 3]) {
    let run = run();
    let (model, _) = build::<B>(&run, sp, group).expect("the plan fits");
    let batch = || run.batch::<B>(0);
    let logits = model.forward(batch().inputs).into_data().to_vec().unwrap();
    let partial = SequencePartial::of(&model, &plan(group, sp));
    let before = counts(group);
    let loss = tensor_parallel::loss(&model, batch());
    let after_forward = counts(group);
    let mut grads = GradientsParams::from_grads(loss.backward(), &model);
    let after_backward = counts(group);
    partial
        .sum::<<B as AutodiffBackend>::InnerBackend>(&mut grads, group)
        .expect("sequence-partial sum");
    let windows = [
        since(after_forward, before),
        since(after_backward, after_forward),
        since(counts(group), after_backward),
    ];
    let gradients = model.map(&mut AsGradients(&grads)).parameters();
    (logits, gradients, windows)
}

/// Under `wildfire launch` (`WILDFIRE_TP_EXAMPLE_REPORT` set): one rank of a 2-process
/// tensor-parallel run, which writes its [`RankReport`].
#[test]
#[ignore = "a rank of the jobs run_processes launches"]
fn example_rank_under_launch() {
    let report = launched_var("WILDFIRE_TP_EXAMPLE_REPORT");
    let sequence_parallel = std::env::var("WILDFIRE_TP_EXAMPLE_SP").is_ok_and(|v| v == "1");
    let dims = ParallelDims {
        tp: 2,
        sequence_parallel,
        ..ParallelDims::default()
    };
    let mesh = Mesh::from_env(dims).unwrap();
    let group = mesh.tensor();
    let (logits, gradients, collectives) = first_step(sequence_parallel, group);
    let (model, losses) = tensor_parallel::train::<B>(&run(), sequence_parallel, group).unwrap();
    let report_of_rank = RankReport {
        logits,
        gradients,
        collectives,
        losses,
        parameters: model.parameters(),
    };
    let path = format!("{report}.rank-{}.json", group.rank());
    std::fs::write(path, serde_json::to_string(&report_of_rank).unwrap()).unwrap();
}

/// The 2 ranks' reports of a run as processes (each rank its own process: Burn's autodiff
/// registry is per process, and its collectives run inside forwards and backwards).
fn run_processes(sequence_parallel: bool, dir: &Path) -> Vec<RankReport> {
    let report = dir.join(format!("tp-sp{}.report", u8::from(sequence_parallel)));
    let mut command = launch_test_ranks(2, "tensor_parallel_example::example_rank_under_launch");
    command.env("WILDFIRE_TP_EXAMPLE_REPORT", &report).env(
        "WILDFIRE_TP_EXAMPLE_SP",
        u8::from(sequence_parallel).to_string(),
    );
    let finished = run_with_limit(&mut command, LIMIT);
    assert_eq!(finished.code, Some(0), "{}", finished.output());
    rank_reports(&report, 2, &finished)
}

/// The unsplit model's first-step logits and losses, and its first-step gradients and trained
/// parameters with each rank's part cut by the plan.
struct Serial {
    logits: Vec<f32>,
    gradients: Vec<Vec<f32>>,
    parameters: Vec<Vec<f32>>,
    losses: Vec<f32>,
}

/// The unsplit model's run, its parts cut by the plan with or without sequence parallelism
/// (`sp`; the unsplit model computes the same either way).
fn serial(sp: bool) -> Serial {
    let (run, solo) = (run(), solo());
    let (model, _) = build::<B>(&run, false, &solo).unwrap();
    let batch = run.batch::<B>(0);
    let logits = model
        .forward(batch.inputs.clone())
        .into_data()
        .to_vec()
        .unwrap();
    let partial = SequencePartial::of(&model, &plan(&solo, false));
    let (grads, _) = tensor_parallel::gradients(&model, batch, &partial, &solo).unwrap();
    let gradients = model.map(&mut AsGradients(&grads));
    let (trained, losses) = tensor_parallel::train::<B>(&run, false, &solo).unwrap();
    // Cutting by a plan communicates nothing: the handles of a 2-rank world name the parts.
    let ranks = ProcessGroup::local_world(2, options(60.0, false)).unwrap();
    let cut = |model: &Mlp<B>| -> Vec<Vec<f32>> {
        (ranks.iter())
            .map(|rank| apply_plan(model.clone(), &plan(rank, sp), rank).unwrap())
            .map(|part| part.parameters())
            .collect()
    };
    Serial {
        logits,
        gradients: cut(&gradients),
        parameters: cut(&trained),
        losses,
    }
}

/// Two processes at tp 2, with and without sequence parallelism, against the unsplit model: the
/// first step's logits and gradients, the collectives it issues, and 10 AdamW steps' losses and
/// parameters. Without sequence parallelism a step communicates one all-reduce forward (after
/// the row-parallel block) and one backward (the column-parallel block's input gradient); with
/// it, an all-gather into the column-parallel block, a reduce-scatter out of the row-parallel
/// one and an all-gather leaving the region, the same backward, and the row-parallel bias's
/// gradient summed (one all-reduce).
#[test]
fn the_example_at_tp_2_trains_as_the_serial_model() {
    let dir = std::env::temp_dir().join(format!("wildfire-tp-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for sequence_parallel in [false, true] {
        let expected = serial(sequence_parallel);
        let collectives: [[u64; 3]; 3] = match sequence_parallel {
            false => [[0, 0, 1], [0, 0, 1], [0, 0, 0]],
            true => [[2, 1, 0], [2, 1, 0], [0, 0, 1]],
        };
        for (rank, report) in run_processes(sequence_parallel, &dir).iter().enumerate() {
            let what = format!("rank {rank}, sequence parallel {sequence_parallel}");
            assert_eq!(
                report.collectives, collectives,
                "{what}: [AG, RS, AR] forward, backward, sequence-partial sum"
            );
            assert_eq!(report.losses.len(), run().steps, "{what}: steps");
            let differences = [
                (
                    "logits",
                    relative_difference(&widened(&report.logits), &widened(&expected.logits)),
                ),
                (
                    "gradients",
                    relative_difference(
                        &widened(&report.gradients),
                        &widened(&expected.gradients[rank]),
                    ),
                ),
                (
                    "losses",
                    relative_difference(&widened(&report.losses), &widened(&expected.losses)),
                ),
                (
                    "parameters after 10 steps",
                    relative_difference(
                        &widened(&report.parameters),
                        &widened(&expected.parameters[rank]),
                    ),
                ),
            ];
            for (name, difference) in differences {
                println!("{what}: {name} {difference:.1e} apart");
                assert!(
                    difference <= TOLERANCE,
                    "{what}: {name} {difference:e} apart"
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A plan naming a path the model lacks, one whose split does not divide, and one that splits
/// a layer that is Burn's `Linear` (which would compute with its slice and never communicate)
/// are refused naming the path and sizes, by `check_plan` (which leaves the caller the model)
/// and by `apply_plan` alike.
#[test]
fn a_plan_that_does_not_fit_the_example_is_refused() {
    let results = run_thread_ranks(2, options(60.0, false), LIMIT, |group| {
        // No collective runs here: the ranks take Burn's autodiff registry in turns.
        let _lock = wildfire_parallel::pp::graphs_lock();
        let model = || {
            let device = Default::default();
            Mlp::<B>::new(
                &device,
                Shape {
                    width: 30,
                    blocks: 2,
                },
                StepLog::default(),
            )
        };
        let refuse = |rules: &[(&str, TpStyle)]| {
            let plan = TpPlan::new(rules, group.rank(), group.size());
            let kept = model();
            let checked = check_plan(&kept, &plan, &group).unwrap_err();
            let applied = apply_plan(kept, &plan, &group).unwrap_err();
            assert_eq!(checked, applied, "check_plan and apply_plan refuse alike");
            applied
        };
        let missing = refuse(&[("blocks.2.module.linear", TpStyle::Row)]);
        // 30 columns split over 2 ranks divide; in 4 sections they do not.
        let indivisible = refuse(&[(
            "blocks.0.module.linear",
            TpStyle::Column {
                sections: 4,
                gather_output: false,
            },
        )]);
        let burn_linear = refuse(&[("input", TpStyle::COLUMN)]);
        let fits = apply_plan(
            model(),
            &TpPlan::new(TP_PLAN, group.rank(), group.size()),
            &group,
        );
        (missing, indivisible, burn_linear, fits.is_ok())
    });
    for (missing, indivisible, burn_linear, fits) in results {
        assert!(fits, "the example's own plan fits width 30 at tp 2");
        assert!(
            matches!(&missing, PlanError::NoMatch { rule, .. } if rule == "blocks.2.module.linear"),
            "{missing}"
        );
        assert_eq!(
            indivisible.to_string(),
            "parameter `blocks.0.module.linear.weight` of shape [30, 30] cannot be split \
             column-parallel in 4 sections over 2 ranks: dimension 1 holds 30 entries, not a \
             multiple of 8"
        );
        assert!(
            matches!(&burn_linear, PlanError::WrongLayer { path, .. } if path == "input.weight"),
            "{burn_linear}"
        );
        println!("refused: {missing}\nrefused: {indivisible}\nrefused: {burn_linear}");
    }
}
