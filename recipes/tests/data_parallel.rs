//! Data parallelism as a user runs it: `wildfire train --dp N --zero S`, ranks as threads
//! (`--transport local`) or processes (`wildfire launch`), checked against serial training and
//! against each other.
//!
//! Exactness. Gradients are summed in rank order after each rank sums its micro-batches, so DDP
//! equals serial training bitwise when every rank has one micro-batch (dp = 4 here); with two
//! per rank, `(g₁ + g₂) + (g₃ + g₄)` is not serial's `((g₁ + g₂) + g₃) + g₄`, and AdamW, which
//! divides by `√v̂ + ε`, turns those ulps into parameter differences (losses stay within 1e-6).
//! ZeRO 1 and 2 reduce in DDP's order and update elementwise like DDP, but the global gradient
//! norm sums its squares per shard where DDP sums them per tensor: the norms differ by about
//! 1e-8 relative, and where that crosses an f32 rounding of a clipped step's factor the update
//! differs by an ulp, which AdamW carries on. ZeRO 2 and offloading equal ZeRO 1 bitwise (the
//! same shards, so the same norm on every SIMD width). ZeRO 3 cuts its buckets at unit (block)
//! boundaries, so its shards, and the pieces its norm sums, are not ZeRO 1's either: how those
//! f32 sums round depends on the SIMD width (Flex's sum adds 8 or 16 lanes). ZeRO 3 also sums
//! its tied embedding's two copies (the head's lives in another unit) per step, `Σe + Σh`,
//! where DDP's autodiff sums per micro-batch. Parameter differences are relative to the
//! tensor's largest value, key biases aside (see `common::is_key_bias`).
//!
//! How far these ulps grow depends on the training trajectory, not on the parallel code, so the
//! bounds come from several seeds, with the fused ops (the default) and with the decomposed ops
//! (`train.fused_ops = false`), worst over 10 steps. `WILDFIRE_TEST_SET="train.seed=1
//! train.fused_ops=false"` (see `common::base_args`) runs these tests on another trajectory;
//! 2026-12-01, after the native loops' exp changed (Flex's AVX-512 matmuls changed no digit of
//! the decomposed column):
//!
//! | comparison | fused: seed 1337 (here), 0, 1, 2 | decomposed: 1337, 1, 2 | asserted |
//! |---|---|---|---|
//! | DDP 2 × 2 micro-batches vs serial | 1.2e-5, 1.3e-5, 1.9e-5, 8.8e-5 | 2.7e-5, 4.1e-5, 1.5e-5 | ≤ 1.5e-4 |
//! | ZeRO 1 vs DDP | 1.0e-5, 5.8e-7, 1.7e-5, 5.3e-7 | 0, 9.5e-6, 0 | ≤ 5e-5 |
//! | ZeRO 3 vs DDP (tied) | 4.8e-6, 5.7e-6, 6.4e-5, 2.6e-5 | 7.6e-6, 3.1e-5, 1.7e-5 | ≤ 1e-4 |
//! | ZeRO 3 vs DDP (untied) | 3.5e-6, 5.8e-7, 6.1e-7, 8.0e-7 | 0, 4.4e-7, 4.6e-7 | ≤ 1e-5 |
//!
//! On 2026-11-30, with the C library's `expf`, the fused column read 7.3e-5, 1.6e-5, 4.6e-5,
//! 3.8e-5; 1.8e-6, 3.9e-7, 1.6e-5, 2.2e-6; 9.6e-6, 5.1e-6, 2.9e-5, 1.4e-5; 1.3e-7, 9.4e-8,
//! 8.5e-7, 9.5e-8 (the decomposed one as now), and the untied ZeRO 3 bound was 2e-6, which
//! seed 1337's new trajectory broke. (Before that the bounds were 5e-5, 1e-6, 5e-5 and 1e-6,
//! set from seed 1337 on the decomposed ops; seed 1 broke the ZeRO 1 one on either path.) Bugs
//! in the parallel code show up far above these bounds, and the bitwise checks (DDP with one
//! micro-batch per rank, ZeRO 2 and offload against ZeRO 1, resume) hold on every seed.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;
use wildfire_recipes::checkpoint;

/// The shared base arguments with `accumulation` micro-batches per rank per step, keeping
/// every step's checkpoint.
fn dp_args(dir: &Path, accumulation: usize) -> Vec<String> {
    let mut args = base_args(dir);
    // base_args starts with `train --microbatches 4`.
    args[2] = accumulation.to_string();
    args.extend(
        [
            "--set",
            "checkpoint.every=1",
            "--set",
            "checkpoint.keep_last=0",
        ]
        .map(String::from),
    );
    args
}

fn dp_train(name: &str, accumulation: usize, extra: &[&str]) -> RunDir {
    let dir = run_dir(name);
    let mut args = dp_args(&dir, accumulation);
    args.extend(extra.iter().map(|s| s.to_string()));
    let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
    assert!(out.status.success(), "{args:?}:\n{}", text(&out));
    dir
}

/// DDP over 2 and 4 thread ranks trains like serial training on the concatenated batch (the
/// same global batch of 8 sequences: 4 micro-batches serially, 2 or 1 per rank); see the
/// module doc for the tolerances.
#[test]
fn ddp_trains_like_serial_training_on_the_concatenated_batch() {
    let serial = dp_train("dp-serial", 4, &[]);
    for (dp, accumulation, tolerance) in [("2", 2, 1.5e-4), ("4", 1, 0.0)] {
        let name = format!("ddp-{dp}");
        let run = dp_train(&name, accumulation, &["--dp", dp, "--transport", "local"]);
        assert_same_training(&serial, &run, &name, tolerance);
        assert_step_reads(&run, 0, &name);
    }
    assert_step_reads(&serial, 0, "serial");
}

/// ZeRO stages 1, 2 and 3 (and offload) train like DDP on 2 ranks, with 2 micro-batches per
/// rank; see the module doc for the tolerances.
#[test]
fn every_zero_stage_trains_like_ddp() {
    let ddp = dp_train("zero-0", 2, &["--dp", "2", "--transport", "local"]);
    let ddp_untied = dp_train(
        "zero-0-untied",
        2,
        &[
            "--dp",
            "2",
            "--transport",
            "local",
            "--set",
            "model.tie_embeddings=false",
        ],
    );
    // (flags, compared with, tolerance): see the module doc.
    let stages: [(&[&str], &str, f32); 6] = [
        (&["--zero", "1"], "ddp", 5e-5),
        (&["--zero", "2"], "zero-zero1", 0.0),
        (&["--zero", "1", "--offload-optimizer"], "zero-zero1", 0.0),
        (&["--zero", "3"], "ddp", 1e-4),
        (&["--zero", "3", "--offload-optimizer"], "zero-zero3", 0.0),
        (
            &["--zero", "3", "--set", "model.tie_embeddings=false"],
            "ddp-untied",
            1e-5,
        ),
    ];
    let mut runs = std::collections::HashMap::from([("ddp".to_string(), ddp)]);
    runs.insert("ddp-untied".into(), ddp_untied);
    for (flags, compared_with, tolerance) in stages {
        let name = format!("zero{}", flags.join("").replace("--", "-"));
        let mut extra = vec!["--dp", "2", "--transport", "local"];
        extra.extend(flags);
        let run = dp_train(&name, 2, &extra);
        let what = format!("{name} against {compared_with}");
        assert_same_training(&runs[compared_with], &run, &what, tolerance);
        if !flags.contains(&"--offload-optimizer") {
            // The loss and the norm stay on the device; offloading reads by design.
            assert_step_reads(&run, 0, &what);
        }
        assert_eq!(
            series(&run, "eval", "val_loss").len(),
            1,
            "{name}: evaluated"
        );
        runs.insert(name, run);
    }
}

/// Under every stage, and under ZeRO 1 with a 2-stage pipeline (whose last stage holds the tied
/// embedding's copy), a run stopped after its step-5 checkpoint and resumed gives the losses and
/// parameters of an uninterrupted run, bitwise (the resumed run drops the metrics of the steps
/// it redoes).
#[test]
fn every_zero_stage_resumes_bitwise() {
    for (stage, pp) in [("0", "1"), ("1", "1"), ("2", "1"), ("3", "1"), ("1", "2")] {
        let flags = [
            "--dp",
            "2",
            "--pp",
            pp,
            "--zero",
            stage,
            "--transport",
            "local",
        ];
        let whole = dp_train(&format!("resume-whole-{stage}-pp{pp}"), 2, &flags);
        let dir = dp_train(&format!("resume-{stage}-pp{pp}"), 2, &flags);
        remove_checkpoints(&dir, 6..=10);
        let mut args = dp_args(&dir, 2);
        args.extend(["--resume"].map(String::from));
        let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
        assert!(out.status.success(), "{}", text(&out));
        let what = format!("ZeRO-{stage}, pp {pp}: resume");
        assert_eq!(
            series(&dir, "train", "loss"),
            series(&whole, "train", "loss"),
            "{what}: losses"
        );
        assert_eq!(params_by_step(&dir), params_by_step(&whole), "{what}");
    }
}

/// A ZeRO 3 checkpoint (parameters and moments in flat pieces) resumes under ZeRO 1 (whole
/// parameters, sharded moments). The first step after the resume computes the loss of the
/// loaded parameters, the same forward as ZeRO 3's on the same values: bitwise ZeRO 3's loss of
/// that step. From there it trains like an uninterrupted ZeRO 1 run within the ZeRO 1 vs DDP
/// bound of the module doc, not bitwise: ZeRO 3 cuts its buckets at unit (block) boundaries and
/// ZeRO 1 does not, so the two sum the gradient norm's squares over other pieces, whose f32
/// sums round differently with Flex's 16 lanes (AVX-512) than with 8 (AVX2). Measured on
/// 2026-12-02 (seed 1337): the first step's norms are 2e-13 apart (relative) on the AVX-512 path
/// and 8e-10 on the AVX2 one (`scripts/avx2-only.sh`), where the clipped step's f32 factor moves
/// by an ulp, AdamW carries it on and the parameters end 5.6e-6 apart; on AVX-512 they stay
/// bitwise alike, by luck of the rounding.
#[test]
fn a_zero3_checkpoint_resumes_under_zero1() {
    let untied = [
        "--set",
        "model.tie_embeddings=false",
        "--transport",
        "local",
        "--dp",
        "2",
    ];
    let zero1: Vec<&str> = untied.iter().copied().chain(["--zero", "1"]).collect();
    let whole = dp_train("restage-whole", 2, &zero1);
    let zero3: Vec<&str> = untied.iter().copied().chain(["--zero", "3"]).collect();
    let dir = dp_train("restage", 2, &zero3);
    let zero3_losses = series(&dir, "train", "loss");
    remove_checkpoints(&dir, 6..=10);
    let mut args = dp_args(&dir, 2);
    args.extend(["--resume", "--zero", "1"].map(String::from));
    let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("2 ranks, ZeRO-1"), "{}", text(&out));
    let resumed_losses = series(&dir, "train", "loss");
    assert_eq!(
        resumed_losses[..6],
        zero3_losses[..6],
        "the loss of the loaded parameters (step 6) and those before it"
    );
    assert_same_training(
        &whole,
        &dir,
        "ZeRO 3 resumed as ZeRO 1 against ZeRO 1",
        5e-5,
    );
}

/// A checkpoint saved at dp 2 resumes at dp 4 and one saved at dp 4 at dp 2, under every ZeRO
/// stage, with a stage change, and with offload: the global batch of 8 sequences is kept (2
/// micro-batches per rank at dp 2, one at dp 4, derived from the checkpoint's), so the resumed
/// steps draw the same samples, and the run continues the uninterrupted one within the bounds of
/// the module doc: dp 4 sums its gradients as serial training does and dp 2 does not (DDP 2 × 2
/// against serial), and ZeRO 3 adds its own sums (ZeRO 3 against DDP) on top. Measured on
/// 2026-12-02 (AVX-512): at most 2.0e-7 over the five resumed steps.
#[test]
fn a_checkpoint_resumes_at_another_dp() {
    let flags = |dp: usize, stage: &str| -> Vec<String> {
        let dp = dp.to_string();
        ["--dp", &dp, "--zero", stage, "--transport", "local"]
            .map(String::from)
            .to_vec()
    };
    let mut uninterrupted = std::collections::HashMap::new();
    // (dp and stage saved, dp and stage resumed, extra flags on both, tolerance)
    type Layout<'a> = (usize, &'a str);
    let cases: [(Layout, Layout, &[&str], f32); 10] = [
        ((2, "0"), (4, "0"), &[], 1.5e-4),
        ((4, "0"), (2, "0"), &[], 1.5e-4),
        ((2, "1"), (4, "1"), &[], 1.5e-4),
        ((4, "1"), (2, "1"), &[], 1.5e-4),
        ((2, "2"), (4, "2"), &[], 1.5e-4),
        ((4, "2"), (2, "2"), &[], 1.5e-4),
        ((2, "3"), (4, "3"), &[], 2.5e-4),
        ((4, "3"), (2, "3"), &[], 2.5e-4),
        ((2, "1"), (4, "3"), &[], 2.5e-4),
        ((4, "3"), (2, "2"), &["--offload-optimizer"], 2.5e-4),
    ];
    for ((dp, stage), (to_dp, to_stage), extra, tolerance) in cases {
        let accumulation = 4 / dp;
        let name = format!("redp-{dp}-zero{stage}{}", extra.concat());
        let whole = uninterrupted.entry(name.clone()).or_insert_with(|| {
            let mut saved = flags(dp, stage);
            saved.extend(extra.iter().map(|s| s.to_string()));
            let saved: Vec<&str> = saved.iter().map(String::as_str).collect();
            dp_train(&name, accumulation, &saved)
        });
        let what = format!(
            "dp {dp} ZeRO {stage} resumed at dp {to_dp} ZeRO {to_stage}{}",
            extra.concat()
        );
        let dir = run_dir(&format!("{name}-to-{to_dp}-zero{to_stage}"));
        copy_dir(whole, &dir);
        remove_checkpoints(&dir, 6..=10);
        // The saved accumulation on the command line: the resume derives the one that keeps
        // the global batch.
        let mut args = dp_args(&dir, accumulation);
        args.push("--resume".into());
        args.extend(flags(to_dp, to_stage));
        args.extend(extra.iter().map(|s| s.to_string()));
        let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
        assert!(out.status.success(), "{what}: {}", text(&out));
        let expected = format!("{to_dp} ranks, ZeRO-{to_stage}");
        assert!(text(&out).contains(&expected), "{what}: {}", text(&out));
        assert_same_training(whole, &dir, &what, tolerance);
    }
}

/// A 2-node job (one launcher per node, one rank each, both on this host) whose node-1 rank is
/// SIGKILLed: node 1's launcher names the signal, and node 0's fails within seconds (not at the
/// 60 s communication deadline) naming its rank's error, which names the lost rank.
#[test]
fn a_node_whose_rank_dies_fails_the_other_node_fast() {
    let dir = run_dir("two-nodes");
    let mut train = base_args(&dir);
    train.extend(["--dp", "2", "--set", "train.max_steps=100000"].map(String::from));
    let node = |rank: usize| {
        let mut launcher = Command::new(env!("CARGO_BIN_EXE_wildfire"));
        launcher
            .args(["launch", "--nnodes", "2", "--nproc-per-node", "1"])
            .args([
                "--node-rank",
                &rank.to_string(),
                "--master-port",
                "29705",
                "--",
            ])
            .arg(env!("CARGO_BIN_EXE_wildfire"))
            .args(&train)
            .env("WILDFIRE_JOB_TOKEN", "two-nodes-secret")
            .env("WILDFIRE_ADVERTISE_ADDR", "127.0.0.1")
            .env("WILDFIRE_COMM_TIMEOUT", "60");
        spawn_command(&mut launcher)
    };
    let (node0, node1) = (node(0), node(1));
    let started = Instant::now();
    while records_if_any(&dir) < 2 {
        assert!(started.elapsed() < LIMIT, "no progress");
        std::thread::sleep(Duration::from_millis(10));
    }
    let victim = child_with_rank(node1.id(), 1).expect("rank 1's process");
    let killed = Instant::now();
    // SAFETY: kill(2) on a pid read from /proc.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    let (out0, out1) = (finish(node0, LIMIT), finish(node1, LIMIT));
    let detected = killed.elapsed();
    let (log0, log1) = (text(&out0), text(&out1));
    assert!(
        !out1.status.success() && log1.contains("rank 1 (pid"),
        "{log1}"
    );
    assert!(log1.contains("SIGKILL"), "node 1 names the signal: {log1}");
    assert!(!out0.status.success(), "{log0}");
    let failure = log0
        .lines()
        .find(|line| line.starts_with("wildfire launch: rank 0"))
        .unwrap_or_else(|| panic!("node 0's launcher names its failed rank: {log0}"));
    assert!(
        failure.contains("its last words") && failure.contains("rank 1"),
        "node 0's launcher names the cause: {failure}"
    );
    assert!(
        detected < Duration::from_secs(20),
        "took {detected:?}: {log0}"
    );
    println!("node 0 stopped {detected:?} after the kill: {failure}");
}

/// Checkpoints written in the background (`checkpoint.async`) hold what synchronous ones hold,
/// bitwise, at every step, and training is unchanged by them; with `keep_last` the background
/// writer prunes as a synchronous save does.
#[test]
fn background_checkpoints_equal_synchronous_ones() {
    let flags = ["--dp", "2", "--zero", "1", "--transport", "local"];
    let synchronous = dp_train("ckpt-sync", 2, &flags);
    let mut background_flags = flags.to_vec();
    background_flags.extend(["--set", "checkpoint.async=true"]);
    let background = dp_train("ckpt-async", 2, &background_flags);
    assert_same_training(&synchronous, &background, "background checkpoints", 0.0);
    background_flags.extend(["--set", "checkpoint.keep_last=2"]);
    let pruned = dp_train("ckpt-async-pruned", 2, &background_flags);
    let kept: Vec<u64> = checkpoint::store::list_checkpoints(&pruned.join("checkpoints"))
        .expect("checkpoints")
        .into_iter()
        .map(|(step, _)| step)
        .collect();
    assert_eq!(kept, [9, 10]);
}

/// Bad data-parallel settings are refused before training, naming every number.
#[test]
fn bad_data_parallel_settings_are_named() {
    let cases: [(&[&str], &str); 6] = [
        (
            &["--offload-optimizer"],
            "parallel.offload_optimizer = true offloads ZeRO's sharded optimizer, but \
             parallel.zero = 0 keeps Burn's replicated one",
        ),
        (
            &[
                "--dp",
                "2",
                "--zero",
                "3",
                "--set",
                "model.dropout=0.1",
                "--transport",
                "local",
            ],
            "ZeRO stage 3 recomputes each block's forward in its backward, which draws new \
             dropout masks: it needs model.dropout = 0, not 0.1",
        ),
        (
            &["--dp", "2", "--global-batch", "12", "--transport", "local"],
            "the global batch is 12 sequences, but micro-batch 2 × accumulation 4 × dp 2 = 16",
        ),
        (
            &[
                "--dp",
                "2",
                "--pp",
                "2",
                "--zero",
                "3",
                "--transport",
                "local",
            ],
            "ZeRO stage 3 shards the parameters of the pipeline stage a rank holds and needs pp \
             = 1",
        ),
        (
            &["--zero", "4"],
            "parallel.zero = 4 is not a ZeRO stage (0, 1, 2 or 3)",
        ),
        (
            &["--dp", "2"],
            "the world has 1 ranks, but dp 2 × tp 1 × pp 1 = 2",
        ),
    ];
    assert_refused("bad-dp", &cases);
}

/// A data-parallel rank killed mid-run (processes) fails the job well within the deadline, and
/// a relaunch with `--resume` continues from the last complete checkpoint.
#[test]
fn a_killed_data_parallel_rank_fails_the_job_and_a_relaunch_resumes() {
    let dir = run_dir("dp-killed");
    let mut train_args = dp_args(&dir, 2);
    train_args.extend(
        [
            "--dp",
            "2",
            "--zero",
            "2",
            "--set",
            "train.max_steps=100000",
        ]
        .map(String::from),
    );
    assert_killed_rank_fails_the_job(&dir, 2, 29681, train_args, 1);

    let (last, _) = checkpoint::store::list_checkpoints(&dir.join("checkpoints"))
        .expect("checkpoints")
        .into_iter()
        .last()
        .expect("a complete checkpoint before the kill");
    let target = last + 2;
    let args = [
        "train".to_string(),
        "--resume".into(),
        dir.display().to_string(),
        "--set".into(),
        format!("train.max_steps={target}"),
    ];
    let out = launch(2, 29682, &args);
    assert!(out.status.success(), "{}", text(&out));
    let steps: Vec<u64> = records(&dir, "train")
        .iter()
        .map(|v| v["step"].as_u64().expect("step"))
        .collect();
    assert_eq!(
        &steps[steps.len() - 2..],
        [last, last + 1],
        "the relaunch continues at step {last}: {steps:?}"
    );
}

/// How a test makes a rank of a running job die.
enum Fault<'a> {
    /// SIGKILL rank 1 from outside once the run directory passes this check.
    KillWhen(&'a dyn Fn(&Path) -> bool),
    /// `WILDFIRE_CRASH_AT=POINT:STEP:RANK`: the rank SIGKILLs itself inside that checkpoint's
    /// write (see `checkpoint::crash_point`).
    CrashAt(&'a str),
}

/// A job that `wildfire launch --max-restarts 1` restarts after a rank is SIGKILLed continues
/// the uninterrupted run with `wildfire train --resume auto`: the same final parameters, bitwise,
/// and each step's record once. Killed after a checkpoint, it continues from the newest one;
/// killed before the first, it starts again. Killed inside the write of the step-8 checkpoint,
/// written synchronously or in the background (`checkpoint.async`), between the shard files
/// (rank 1 before its own, rank 0's written) or before the commit (every shard written), it
/// continues from the step-4 checkpoint and the restart removes the unfinished write.
#[test]
fn a_restarted_job_continues_the_uninterrupted_run() {
    const STEPS: u64 = 40;
    let train = |dir: &Path, every: u64, background: bool| -> Vec<String> {
        let mut args = base_args(dir);
        args.extend([
            "--dp".to_string(),
            "2".into(),
            "--resume".into(),
            "auto".into(),
            "--set".into(),
            format!("checkpoint.every={every}"),
            "--set".into(),
            format!("checkpoint.async={background}"),
            "--set".into(),
            "checkpoint.keep_last=0".into(),
            "--set".into(),
            format!("train.max_steps={STEPS}"),
            "--set".into(),
            "train.eval_every=0".into(),
        ]);
        args
    };
    let steps = |dir: &Path| -> Vec<u64> {
        (records(dir, "train").iter())
            .map(|v| v["step"].as_u64().expect("step"))
            .collect()
    };
    let straight = run_dir("restart-straight");
    let out = launch(2, 29691, &train(&straight, 4, false));
    assert!(out.status.success(), "{}", text(&out));
    let expected = params(&straight);
    assert_eq!(steps(&straight), (0..STEPS).collect::<Vec<_>>());

    let has_checkpoint = |dir: &Path| {
        checkpoint::store::list_checkpoints(&dir.join("checkpoints")).is_ok_and(|c| !c.is_empty())
    };
    let two_steps = |dir: &Path| records_if_any(dir) >= 2;
    // (name, checkpoint.every, checkpoint.async, port, fault)
    let cases = [
        (
            "restart-after-checkpoint",
            4,
            false,
            29693,
            Fault::KillWhen(&has_checkpoint),
        ),
        (
            "restart-before-checkpoint",
            0,
            false,
            29695,
            Fault::KillWhen(&two_steps),
        ),
        (
            "crash-between-shards",
            4,
            false,
            29697,
            Fault::CrashAt("before-shard:8:1"),
        ),
        (
            "crash-before-commit",
            4,
            false,
            29699,
            Fault::CrashAt("before-commit:8:0"),
        ),
        (
            "crash-between-shards-async",
            4,
            true,
            29701,
            Fault::CrashAt("before-shard:8:1"),
        ),
        (
            "crash-before-commit-async",
            4,
            true,
            29703,
            Fault::CrashAt("before-commit:8:0"),
        ),
    ];
    for (name, every, background, port, fault) in cases {
        let dir = run_dir(name);
        let mut launcher = Command::new(env!("CARGO_BIN_EXE_wildfire"));
        launcher
            .args(["launch", "--nproc-per-node", "2", "--max-restarts", "1"])
            .args(["--master-port", &port.to_string(), "--"])
            .arg(env!("CARGO_BIN_EXE_wildfire"))
            .args(train(&dir, every, background));
        if let Fault::CrashAt(spec) = fault {
            launcher.env(checkpoint::CRASH_ENV, spec);
        }
        let launcher = spawn_command(&mut launcher);
        if let Fault::KillWhen(ready) = fault {
            let started = Instant::now();
            while !ready(&dir) {
                assert!(started.elapsed() < LIMIT, "{name}: no progress");
                std::thread::sleep(Duration::from_millis(10));
            }
            let pid = child_with_rank(launcher.id(), 1).expect("rank 1's process");
            // SAFETY: kill(2) on a pid read from /proc.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        let out = finish(launcher, LIMIT);
        let log = text(&out);
        assert!(out.status.success(), "{name}: {log}");
        assert!(log.contains("restarting all ranks"), "{name}: {log}");
        if let Fault::CrashAt(spec) = fault {
            assert!(
                log.contains("dies before-"),
                "{name}: {spec} did not fire: {log}"
            );
            assert!(
                log.contains("removed 1 unfinished checkpoint writes")
                    && log.contains("step-00000008"),
                "{name}: the unfinished step-8 write is removed at the restart: {log}"
            );
        }
        assert_eq!(steps(&dir), (0..STEPS).collect::<Vec<_>>(), "{name}");
        assert!(params(&dir) == expected, "{name}: final parameters differ");
        let left = std::fs::read_dir(dir.join("checkpoints")).expect("checkpoints");
        for entry in left {
            let entry = entry.expect("an entry").path();
            assert!(
                entry.join(checkpoint::store::COMMIT_FILE).exists(),
                "{name}: {entry:?} left"
            );
        }
    }
}
