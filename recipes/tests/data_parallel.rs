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

/// Losses at every step within 1e-6 relative, parameters after every step within `tolerance`
/// (relative to each tensor's largest value; 0 asks for bitwise equality, losses included).
fn assert_same_training(reference: &Path, run: &Path, what: &str, tolerance: f32) {
    if tolerance == 0.0 {
        assert_eq!(
            series(reference, "train", "loss"),
            series(run, "train", "loss"),
            "{what}: losses"
        );
        assert_eq!(
            params_by_step(reference),
            params_by_step(run),
            "{what}: parameters"
        );
        return;
    }
    assert_close_losses(
        &series(reference, "train", "loss"),
        &series(run, "train", "loss"),
        1e-6,
        what,
    );
    let worst = worst_over_checkpoints(reference, run, what, max_relative_difference);
    println!(
        "{what}: worst parameter difference {:e} at {}",
        worst.0, worst.1
    );
    assert!(worst.0 <= tolerance, "{what}: {:e} at {}", worst.0, worst.1);
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
    }
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

/// A job that `wildfire launch --max-restarts 1` restarts after rank 1 is SIGKILLed continues
/// the uninterrupted run with `wildfire train --resume auto`: the same final parameters, bitwise,
/// and each step's record once. Killed after a checkpoint, it continues from the newest one;
/// killed before the first, it starts again.
#[test]
fn a_restarted_job_continues_the_uninterrupted_run() {
    const STEPS: u64 = 40;
    let train = |dir: &Path, every: u64| -> Vec<String> {
        let mut args = base_args(dir);
        args.extend([
            "--dp".to_string(),
            "2".into(),
            "--resume".into(),
            "auto".into(),
            "--set".into(),
            format!("checkpoint.every={every}"),
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
    let out = launch(2, 29691, &train(&straight, 4));
    assert!(out.status.success(), "{}", text(&out));
    let expected = params(&straight);
    assert_eq!(steps(&straight), (0..STEPS).collect::<Vec<_>>());

    let has_checkpoint = |dir: &Path| {
        checkpoint::store::list_checkpoints(&dir.join("checkpoints")).is_ok_and(|c| !c.is_empty())
    };
    // (name, checkpoint.every, port, when to kill)
    type Ready<'a> = &'a dyn Fn(&Path) -> bool;
    let cases: [(&str, u64, u16, Ready); 2] = [
        ("restart-after-checkpoint", 4, 29693, &has_checkpoint),
        ("restart-before-checkpoint", 0, 29695, &|dir: &Path| {
            records_if_any(dir) >= 2
        }),
    ];
    for (name, every, port, ready) in cases {
        let dir = run_dir(name);
        let mut args: Vec<String> = ["launch", "--nproc-per-node", "2", "--max-restarts", "1"]
            .map(String::from)
            .to_vec();
        args.extend(["--master-port".into(), port.to_string(), "--".into()]);
        args.push(env!("CARGO_BIN_EXE_wildfire").into());
        args.extend(train(&dir, every));
        let launcher = spawn(env!("CARGO_BIN_EXE_wildfire"), &args);
        let started = Instant::now();
        while !ready(&dir) {
            assert!(started.elapsed() < LIMIT, "{name}: no progress");
            std::thread::sleep(Duration::from_millis(10));
        }
        let pid = child_with_rank(launcher.id(), 1).expect("rank 1's process");
        // SAFETY: kill(2) on a pid read from /proc.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        let out = finish(launcher, LIMIT);
        assert!(out.status.success(), "{name}: {}", text(&out));
        assert!(text(&out).contains("restart"), "{name}: {}", text(&out));
        assert_eq!(steps(&dir), (0..STEPS).collect::<Vec<_>>(), "{name}");
        assert!(params(&dir) == expected, "{name}: final parameters differ");
    }
}
