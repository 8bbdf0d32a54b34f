//! `wildfire train --device wgpu` against `--device cpu`: the recipe on its CubeCL path (the
//! code the CUDA backend runs, Burn's fusion with our kernels queued in its stream, here through
//! WGSL on Mesa's lavapipe), serial and in every parallel layout, with its checkpoints, resume
//! and generation, checked against the CPU run of the same config.
//!
//! Tolerance. Both devices start from the same parameters (drawn on the CPU from the seed) and
//! compute in f32; they differ in summation orders (lavapipe's matmul tiles and reductions
//! against Flex's gemm), in `exp`/`tanh` implementations, a few ulps per operation, and in the
//! gradient norm's sum of per-tensor squares, which the device folds in f32 under Burn's fusion
//! where the CPU folds it in f64 (a relative 2⁻²⁴ per term; the bounds below held unchanged when
//! the sum moved to the device). That is
//! the situation of tensor parallelism against serial training, so the bounds are the same table
//! (`assert_trains_like`): losses within 1e-5 relative at every step, the first gradient norm
//! within 1e-6, every checkpointed element within 2e-4 and at most 1 in 1,000 more than 1e-5
//! apart. Measured after 5 steps of each parallel layout (2026-12-04, AVX-512 Xeon): losses
//! 6.7e-8 apart at worst, elements 3.5e-5, 14 of 4.0 M elements more than 1e-5 apart.
//!
//! Over 20 steps the losses drift further apart, as any two summation orders do once AdamW has
//! amplified the first differences (measured: 2.7e-5 relative at step 16; elements 1.8e-5 at
//! worst, 41 of 16.1 M more than 1e-5 apart; on the AVX2 path, `scripts/avx2-only.sh`, 2.8e-5
//! and 2.8e-5), so the 20-step comparison allows losses 1e-4
//! apart and keeps the element bounds.
//!
//! Every wgpu run reads as burn-cuda may: with `WILDFIRE_MISALIGNED_READS=1`, each read through
//! the decorator hands its bytes back one past an allocation's start, as slices of CubeCL's
//! staging pool can be ([`device_env`]). A reader of device data that views such bytes in place
//! fails the run; the values are the same, so every comparison holds as with aligned reads.
//!
//! Every test here needs a wgpu adapter: without one it prints why and is skipped, unless
//! `WILDFIRE_REQUIRE_WGPU=1` (CI) makes that a failure.

use std::path::Path;

use wildfire_backend::kernels::probe;

use crate::common::*;

/// The bounds for 20 steps: see the module doc.
const TWENTY_STEPS: Bounds = Bounds {
    loss: 1e-4,
    ..SUMMATION_ORDER
};

/// Whether a wgpu adapter answers (see the module doc).
fn has_wgpu() -> bool {
    probe::for_test(probe::wgpu(), "WILDFIRE_REQUIRE_WGPU").is_some()
}

/// The base arguments on `device` with `extra`, keeping every step's checkpoint.
fn device_args(dir: &Path, device: &str, extra: &[&str]) -> Vec<String> {
    let mut args = base_args(dir);
    let keep_every_step = [
        "--set",
        "checkpoint.every=1",
        "--set",
        "checkpoint.keep_last=0",
    ];
    let device = ["--device", device];
    args.extend((keep_every_step.iter().chain(&device).chain(extra)).map(|s| s.to_string()));
    args
}

/// The environment of a run on `device`: misaligned reads on wgpu (see the module doc), the
/// CPU runs, the references, as they are.
fn device_env(device: &str) -> &'static [(&'static str, &'static str)] {
    match device {
        "wgpu" => &[("WILDFIRE_MISALIGNED_READS", "1")],
        _ => &[],
    }
}

/// A run of one process on `device` with `extra`, which must succeed; on wgpu every fused op
/// must have run its CubeCL kernel queued in Burn's fusion stream, and none the reference
/// ([`assert_kernels_under_fusion`]).
fn single(name: &str, device: &str, extra: &[&str]) -> RunDir {
    single_with_output(name, device, extra).0
}

/// [`single`], and what the run printed.
fn single_with_output(name: &str, device: &str, extra: &[&str]) -> (RunDir, String) {
    let dir = run_dir(name);
    let args = device_args(&dir, device, extra);
    let child = spawn_with_env(env!("CARGO_BIN_EXE_wildfire"), &args, device_env(device));
    let out = finish(child, LIMIT);
    let printed = text(&out);
    assert!(out.status.success(), "{args:?}:\n{printed}");
    if device == "wgpu" {
        assert_kernels_under_fusion(&printed, &format!("{args:?}"));
    }
    (dir, printed)
}

/// The profile a run with `--profile 3` printed: a table of kernels for steps 1 to 3 only (the
/// first step's, which compiles the kernels, is dropped), each with its fused elementwise
/// kernels, AdamW's kernel and a total, after a line naming the step's wall time and its
/// blocking reads (none).
fn assert_profiled_three_steps(printed: &str, what: &str) {
    let headers: Vec<&str> = printed
        .lines()
        .filter(|line| line.starts_with("profile of step"))
        .collect();
    assert_eq!(headers.len(), 3, "{what}: {headers:?}\n{printed}");
    for (header, step) in headers.iter().zip(1..) {
        assert!(
            header.starts_with(&format!("profile of step {step}: "))
                && header.ends_with("; 0 blocking reads"),
            "{what}: {header}"
        );
    }
    let tables = printed.split("profile of step").skip(1);
    for table in tables {
        assert!(
            table.contains("ElemwiseFuse")
                && table.contains("AdamwStep")
                && table.contains("  total "),
            "{what}: {table}"
        );
    }
}

/// The kernel paths a `wildfire train` run on wgpu printed (`kernel path: <op>: <path> ×<n>`):
/// the ops of its model (the GPT's attention, bias + GELU and LayerNorm; Llama's attention,
/// RoPE, SwiGLU and RMSNorm) took their CubeCL kernels in the fusion stream, both ways, and
/// no op took the reference.
fn assert_kernels_under_fusion(out: &str, what: &str) {
    let paths: Vec<&str> = out
        .lines()
        .filter_map(|line| line.split_once("kernel path: ").map(|(_, path)| path))
        .collect();
    assert!(!paths.is_empty(), "{what}: no kernel paths printed:\n{out}");
    let ops: &[&str] = match out.contains("training a llama") {
        true => &["attention", "rope", "swiglu", "rms_norm"],
        false => &["attention", "bias_gelu", "layer_norm"],
    };
    for op in ops {
        let fused = |line: &&&str| {
            line.starts_with(op) && line.contains("the CubeCL kernel in the fusion stream")
        };
        assert!(
            paths.iter().any(|line| fused(&line)),
            "{what}: {op} not fused: {paths:?}"
        );
    }
    assert!(
        !paths.iter().any(|line| line.contains("the reference")),
        "{what}: an op ran the reference: {paths:?}"
    );
}

/// A run of `ranks` processes under `wildfire launch` on `device` with `extra`, checked as
/// [`single`] checks its run.
fn launched(name: &str, device: &str, ranks: usize, port: u16, extra: &[&str]) -> RunDir {
    let dir = run_dir(name);
    let args = device_args(&dir, device, extra);
    let out = launch_with_env(ranks, port, &args, device_env(device));
    assert!(out.status.success(), "{args:?}:\n{}", text(&out));
    if device == "wgpu" {
        assert_kernels_under_fusion(&text(&out), &format!("{args:?}"));
    }
    dir
}

/// 20 steps on wgpu follow the CPU run: losses at every step and the parameters of every
/// checkpoint, for the GPT and for llama-tiny (profiled for three steps: `--profile`), every fused
/// op on its kernel in Burn's fusion stream. Then the same checkpoints cross devices: a wgpu run's step-10 checkpoint resumed
/// on the CPU, and the CPU run's resumed on wgpu, continue the trajectory. And greedy generation
/// from the last checkpoint writes the same text on both devices.
#[test]
fn on_wgpu_the_recipe_trains_resumes_and_generates_as_on_cpu() {
    if !has_wgpu() {
        return;
    }
    let twenty = [
        "--set",
        "train.max_steps=20",
        "--set",
        "train.eval_every=20",
    ];
    let cpu = single("device-cpu", "cpu", &twenty);
    let wgpu = single("device-wgpu", "wgpu", &twenty);
    assert_trains_within(&cpu, &wgpu, "wgpu against cpu, 20 steps", TWENTY_STEPS);
    assert_step_reads(&wgpu, 0, "a step on wgpu");
    let llama = [&twenty[..], &["--set", "model.preset=\"llama-tiny\""]].concat();
    let llama_cpu = single("device-cpu-llama", "cpu", &llama);
    // Profiling changes no value: the profiled run trains as the CPU run does.
    let profiled = [&llama[..], &["--profile", "3"]].concat();
    let (llama_wgpu, printed) = single_with_output("device-wgpu-llama", "wgpu", &profiled);
    let what = "llama-tiny on wgpu against cpu, 20 steps";
    assert_trains_within(&llama_cpu, &llama_wgpu, what, TWENTY_STEPS);
    assert_profiled_three_steps(&printed, "llama-tiny on wgpu, --profile 3");

    for (from, to, reference) in [(&wgpu, "cpu", &cpu), (&cpu, "wgpu", &wgpu)] {
        let what = format!("checkpoint of {} resumed on {to}", from.display());
        let resumed = run_dir(&format!("device-resumed-on-{to}"));
        copy_dir(from, &resumed);
        remove_checkpoints(&resumed, 11..=20);
        let mut args = device_args(&resumed, to, &twenty);
        args.push("--resume".into());
        let child = spawn_with_env(env!("CARGO_BIN_EXE_wildfire"), &args, device_env(to));
        let out = finish(child, LIMIT);
        assert!(out.status.success(), "{what}:\n{}", text(&out));
        assert_trains_within(reference, &resumed, &what, TWENTY_STEPS);
    }

    let greedy = |device: &str| {
        let args = [
            "generate",
            "--checkpoint",
            cpu.to_str().unwrap(),
            "--prompt",
            "ROMEO:",
            "--max-new-tokens",
            "24",
            "--temperature",
            "0",
            "--device",
            device,
        ]
        .map(String::from);
        let child = spawn_with_env(env!("CARGO_BIN_EXE_wildfire"), &args, device_env(device));
        let out = finish(child, LIMIT);
        assert!(
            out.status.success(),
            "generate on {device}:\n{}",
            text(&out)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let on_cpu = greedy("cpu");
    assert!(
        on_cpu.starts_with("ROMEO:") && on_cpu.chars().count() > 24,
        "{on_cpu:?}"
    );
    assert_eq!(
        on_cpu,
        greedy("wgpu"),
        "greedy generation on wgpu against cpu"
    );
}

/// Every parallel layout on wgpu trains like its CPU twin: dp 2 and tp 2 over tcp processes,
/// pp 2 on thread ranks with selective activation checkpointing, and ZeRO 3 with the optimizer
/// offloaded and full activation checkpointing (the fused kernels are on in all of them, as by
/// default). Each wgpu run is a process compiling its shaders on lavapipe, so the checkpointing
/// modes ride on the layouts rather than adding runs of their own. A step reads nothing back
/// from the device (offloading the optimizer aside, which moves gradients to the host).
#[test]
fn on_wgpu_every_parallel_layout_trains_like_on_cpu() {
    if !has_wgpu() {
        return;
    }
    let five = ["--set", "train.max_steps=5", "--set", "train.eval_every=5"];
    let with_five = |extra: &[&'static str]| [&five[..], extra].concat();
    for (name, extra) in [
        (
            "pp2-selective-checkpointing",
            with_five(&[
                "--pp",
                "2",
                "--transport",
                "local",
                "--activation-checkpointing",
                "selective",
            ]),
        ),
        (
            "zero3-offload-full-checkpointing",
            with_five(&[
                "--dp",
                "2",
                "--zero",
                "3",
                "--offload-optimizer",
                "--transport",
                "local",
                "--activation-checkpointing",
                "full",
            ]),
        ),
    ] {
        let cpu = single(&format!("device-cpu-{name}"), "cpu", &extra);
        let wgpu = single(&format!("device-wgpu-{name}"), "wgpu", &extra);
        assert_trains_like(&cpu, &wgpu, &format!("{name} on wgpu against cpu"));
        if !extra.contains(&"--offload-optimizer") {
            assert_step_reads(&wgpu, 0, &format!("{name} on wgpu"));
        }
    }
    for (name, extra, port) in [
        ("dp2", with_five(&["--dp", "2"]), 29750),
        ("tp2", with_five(&["--tp", "2"]), 29751),
    ] {
        let cpu = launched(&format!("device-cpu-{name}"), "cpu", 2, port, &extra);
        let wgpu = launched(&format!("device-wgpu-{name}"), "wgpu", 2, port, &extra);
        assert_trains_like(
            &cpu,
            &wgpu,
            &format!("{name} processes on wgpu against cpu"),
        );
        assert_step_reads(&wgpu, 0, &format!("{name} processes on wgpu"));
    }
}

/// What a device cannot do is refused before training, naming the device: CUDA without the
/// build feature or without a driver, TF32 off CUDA, a kernel profile or an index on the CPU,
/// bf16 on wgpu (WGSL has no bf16 type; f16 it has where the adapter does, as lavapipe does).
#[test]
fn devices_refuse_what_they_cannot_do() {
    let cuda = if cfg!(feature = "cuda") {
        "no NVIDIA driver"
    } else {
        "--features cuda"
    };
    let mut cases: Vec<(&[&str], &str)> = vec![
        (&["--device", "cpu:1"], "takes no index"),
        (&["--device", "tpu"], "unknown device \"tpu\""),
        (
            &["--matmul-precision", "tf32"],
            "tf32\" runs on CUDA tensor cores; --device cpu has none",
        ),
        (
            &["--profile", "2"],
            "profiles CubeCL's kernels, which the cpu device does not run",
        ),
    ];
    if has_wgpu() {
        cases.push((
            &["--device", "wgpu", "--precision", "bf16"],
            "precision.compute = \"bf16\" needs bf16 arithmetic, which --device wgpu does not have",
        ));
    }
    // Only where this machine has no GPU does `--device cuda` fail for want of a driver.
    if !Path::new("/dev/nvidia0").exists() {
        cases.push((&["--device", "cuda"], cuda));
    }
    assert_refused("device-refused", &cases);
}
