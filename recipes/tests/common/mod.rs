//! Helpers shared by the integration tests that run the `wildfire` binary.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use wildfire_backend::compare::{assert_same_length, nan_max, within};
pub use wildfire_tests::KillOnDrop;

use burn::tensor::TensorData;
use serde_json::Value;
use wildfire_recipes::checkpoint;

pub const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/data/shakespeare.txt");
/// Every run here is killed after this long.
pub const LIMIT: Duration = Duration::from_secs(240);

/// A test's run directory under the system's temporary directory. It is removed when dropped,
/// unless the test is failing (then it is kept for inspection): a run with a checkpoint every
/// step takes about 100 MB, and a full test pass makes hundreds of them.
pub struct RunDir(PathBuf);

impl std::ops::Deref for RunDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for RunDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// An empty run directory for the test run `name` (in this test process).
pub fn run_dir(name: &str) -> RunDir {
    let dir = std::env::temp_dir().join(format!("wildfire-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    RunDir(dir)
}

/// Config keys that `WILDFIRE_TEST_SET` (space-separated `section.key=value`) adds to every
/// run of [`base_args`]: how the tolerance tables in these tests' docs are measured on other
/// trajectories, e.g. `WILDFIRE_TEST_SET="train.seed=1 train.fused_ops=false"`.
fn test_sets() -> Vec<String> {
    std::env::var("WILDFIRE_TEST_SET")
        .map(|sets| sets.split_whitespace().map(String::from).collect())
        .unwrap_or_default()
}

/// 10 steps of the tiny model (4 blocks) on short windows, 4 micro-batches per step,
/// evaluated at the end.
pub fn base_args(dir: &Path) -> Vec<String> {
    let sets = [
        format!("run.dir={}", dir.display()),
        format!("data.path={CORPUS}"),
        "model.context=32".into(),
        "train.micro_batch=2".into(),
        "train.max_steps=10".into(),
        "train.warmup_steps=2".into(),
        "train.eval_every=10".into(),
        "train.eval_batches=2".into(),
        "checkpoint.every=0".into(),
        "run.threads=1".into(),
    ];
    let mut args = vec!["train".to_string(), "--microbatches".into(), "4".into()];
    for set in sets.into_iter().chain(test_sets()) {
        args.push("--set".into());
        args.push(set);
    }
    args
}

/// [`base_args`] followed by `extra`, where a `--microbatches N` in `extra` replaces the base
/// arguments' 4 instead of following them.
pub fn base_args_with(dir: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = base_args(dir);
    let mut extra = extra.to_vec();
    if let Some(at) = extra.iter().position(|a| *a == "--microbatches") {
        // base_args starts with `train --microbatches 4`.
        args[2] = extra[at + 1].to_string();
        extra.drain(at..at + 2);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// The default recipe's learning curve over 200 steps: the first loss within 0.1 of ln(76)
/// (76 distinct characters in the corpus) and the mean of steps 190..200 below 2.6 (a unigram
/// model of the corpus sits at ≈ 3.3, so this needs the model to use its context).
pub fn assert_learns_the_corpus(losses: &[f64]) {
    assert_eq!(losses.len(), 200);
    assert!(
        (losses[0] - 76f64.ln()).abs() < 0.1,
        "step 0 loss {}",
        losses[0]
    );
    let tail = losses[190..].iter().sum::<f64>() / 10.0;
    assert!(tail < 2.6, "mean loss of steps 190..200 is {tail}");
}

/// Runs `command` to completion or kills it at `limit`; returns its output.
pub fn finish(mut child: KillOnDrop, limit: Duration) -> Output {
    let started = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "killed after {limit:?}:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

/// `wildfire` with `args`, killed at [`LIMIT`]: its output, whether it succeeded or not.
pub fn wildfire_output(args: &[&str]) -> Output {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT)
}

/// `wildfire export --format hf-safetensors` of the run in `dir` to `out`, in files of at most
/// `max_shard` (the command's default when `None`); the export must succeed.
pub fn export_hf(dir: &Path, out: &Path, max_shard: Option<&str>) {
    let mut args = vec![
        "export",
        "--format",
        "hf-safetensors",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    if let Some(max_shard) = max_shard {
        args.extend(["--max-shard-size", max_shard]);
    }
    let result = wildfire_output(&args);
    assert!(result.status.success(), "{args:?}:\n{}", text(&result));
}

/// Starts `program` with `args`, its output piped, under a [`KillOnDrop`] guard.
pub fn spawn(program: &str, args: &[String]) -> KillOnDrop {
    spawn_with_env(program, args, &[])
}

/// [`spawn`] with `vars` added to the child's environment.
pub fn spawn_with_env(program: &str, args: &[String], vars: &[(&str, &str)]) -> KillOnDrop {
    spawn_command(Command::new(program).args(args).envs(vars.iter().copied()))
}

/// Starts `command` with its output piped, under a [`KillOnDrop`] guard.
pub fn spawn_command(command: &mut Command) -> KillOnDrop {
    KillOnDrop::spawn(command.stdout(Stdio::piped()).stderr(Stdio::piped()))
        .unwrap_or_else(|e| panic!("start {command:?}: {e}"))
}

pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `wildfire train` with the base arguments plus `extra`, which must succeed.
pub fn train(name: &str, extra: &[&str]) -> RunDir {
    let dir = run_dir(name);
    let mut args = base_args(&dir);
    args.extend(extra.iter().map(|s| s.to_string()));
    let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
    assert!(out.status.success(), "{args:?}:\n{}", text(&out));
    dir
}

pub fn records(dir: &Path, kind: &str) -> Vec<Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("json"))
        .filter(|v| v["kind"] == kind)
        .collect()
}

pub fn series(dir: &Path, kind: &str, key: &str) -> Vec<f64> {
    records(dir, kind)
        .iter()
        .map(|v| v[key].as_f64().expect(key))
        .collect()
}

/// Every logged step of run `dir` made `reads` blocking reads of device values (rank 0's
/// thread, within the step: `StepRecord::host_reads`; the log interval's read is not a step's).
pub fn assert_step_reads(dir: &Path, reads: u64, what: &str) {
    let counted = series(dir, "train", "host_reads");
    assert!(
        !counted.is_empty() && counted.iter().all(|&r| r == reads as f64),
        "{what}: blocking reads per step {counted:?}, expected {reads} each"
    );
}

/// The directory of run `dir`'s checkpoint of `step`.
pub fn checkpoint_path(dir: &Path, step: u64) -> PathBuf {
    dir.join("checkpoints")
        .join(checkpoint::store::checkpoint_dir_name(step))
}

/// Removes run `dir`'s checkpoints of `steps`, so that a resume starts from an earlier one.
pub fn remove_checkpoints(dir: &Path, steps: std::ops::RangeInclusive<u64>) {
    for step in steps {
        let path = checkpoint_path(dir, step);
        std::fs::remove_dir_all(&path)
            .unwrap_or_else(|e| panic!("removing {}: {e}", path.display()));
    }
}

/// Copies directory `from` (files and subdirectories) to `to`.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create the copy");
    for entry in std::fs::read_dir(from).expect("read the directory") {
        let entry = entry.expect("an entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("its type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy a file");
        }
    }
}

/// The final checkpoint's parameters by name.
pub fn params(dir: &Path) -> BTreeMap<String, TensorData> {
    let latest = checkpoint::resolve(dir).expect("a checkpoint");
    checkpoint::load(&latest).expect("readable").params
}

/// Every checkpoint's parameters, by step.
pub fn params_by_step(dir: &Path) -> BTreeMap<u64, BTreeMap<String, TensorData>> {
    checkpoint::store::list_checkpoints(&dir.join("checkpoints"))
        .expect("checkpoints")
        .into_iter()
        .map(|(step, path)| (step, checkpoint::load(&path).expect("readable").params))
        .collect()
}

/// The arguments of `wildfire launch --nproc-per-node ranks --master-port port -- wildfire`
/// (the command's own arguments follow).
pub fn launch_args(ranks: usize, port: u16) -> Vec<String> {
    vec![
        "launch".into(),
        "--nproc-per-node".into(),
        ranks.to_string(),
        "--master-port".into(),
        port.to_string(),
        "--".into(),
        env!("CARGO_BIN_EXE_wildfire").into(),
    ]
}

/// `wildfire launch --nproc-per-node ranks --master-port port -- wildfire <args>`, run to
/// completion (or killed at [`LIMIT`]).
pub fn launch(ranks: usize, port: u16, args: &[String]) -> Output {
    launch_with_env(ranks, port, args, &[])
}

/// [`launch`] with `vars` added to the environment of the launcher and so of its ranks.
pub fn launch_with_env(ranks: usize, port: u16, args: &[String], vars: &[(&str, &str)]) -> Output {
    let mut command = launch_args(ranks, port);
    command.extend_from_slice(args);
    finish(
        spawn_with_env(env!("CARGO_BIN_EXE_wildfire"), &command, vars),
        LIMIT,
    )
}

/// The largest `difference` between `run`'s checkpoint of each step and `reference`'s (both
/// runs must have checkpoints of the same steps), and where it is.
pub fn worst_over_checkpoints(
    reference: &Path,
    run: &Path,
    what: &str,
    mut difference: impl FnMut(
        &BTreeMap<String, TensorData>,
        &BTreeMap<String, TensorData>,
    ) -> (f32, String),
) -> (f32, String) {
    let (expected, got) = (params_by_step(reference), params_by_step(run));
    assert_eq!(
        expected.keys().collect::<Vec<_>>(),
        got.keys().collect::<Vec<_>>(),
        "{what}: checkpoint steps"
    );
    let mut worst = (0.0f32, String::new());
    for (step, params) in &expected {
        let (value, at) = difference(params, &got[step]);
        if is_worse(value, worst.0) {
            worst = (value, format!("step {step}: {at}"));
        }
    }
    worst
}

/// How far a run may drift from its reference: losses at every step (relative), any checkpointed
/// element (absolute), and the share of elements more than 1e-5 apart (at most 1 in
/// `one_in_over_1e5`).
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub loss: f64,
    pub element: f32,
    pub one_in_over_1e5: usize,
}

/// The bounds of `tensor_parallel`'s module doc, for 10 steps: they bound what different
/// summation orders do to a trajectory (AdamW turns a few ulps in a gradient near ε into
/// visible steps).
pub const SUMMATION_ORDER: Bounds = Bounds {
    loss: 1e-5,
    element: 2e-4,
    one_in_over_1e5: 1_000,
};

/// [`assert_trains_within`] the [`SUMMATION_ORDER`] bounds.
pub fn assert_trains_like(reference: &Path, run: &Path, what: &str) {
    assert_trains_within(reference, run, what, SUMMATION_ORDER);
}

/// `run` against `reference` within `bounds`, and the first step's gradient norm (before the
/// parameters can differ) within 1e-6 relative; the measured worst cases are printed first.
pub fn assert_trains_within(reference: &Path, run: &Path, what: &str, bounds: Bounds) {
    let mut over = (0, 0);
    let worst = worst_over_checkpoints(reference, run, what, |expected, got| {
        let (count, total) = count_differences_over(expected, got, 1e-5);
        over = (over.0 + count, over.1 + total);
        max_param_difference(expected, got)
    });
    let (reference_losses, losses) = (
        series(reference, "train", "loss"),
        series(run, "train", "loss"),
    );
    assert_same_length(reference_losses.len(), losses.len());
    let losses = nan_max(
        reference_losses
            .iter()
            .zip(losses)
            .map(|(a, b)| (a - b).abs() / a),
    );
    println!(
        "{what}: worst loss difference {losses:e} (relative), worst parameter difference {:e} \
         at {}, {} of {} checkpointed elements more than 1e-5 apart",
        worst.0, worst.1, over.0, over.1
    );
    assert_close_losses(
        &series(reference, "train", "loss"),
        &series(run, "train", "loss"),
        bounds.loss,
        what,
    );
    let norms = [reference, run].map(|dir| series(dir, "train", "grad_norm")[0]);
    assert!(
        (norms[0] - norms[1]).abs() <= 1e-6 * norms[0],
        "{what}: first gradient norm {} serially, {} here",
        norms[0],
        norms[1]
    );
    assert!(
        worst.0 <= bounds.element,
        "{what}: {:e} at {}",
        worst.0,
        worst.1
    );
    assert!(
        over.0 * bounds.one_in_over_1e5 <= over.1,
        "{what}: {} of {} elements more than 1e-5 apart",
        over.0,
        over.1
    );
}

pub fn assert_close_losses(serial: &[f64], parallel: &[f64], tolerance: f64, what: &str) {
    assert_eq!(serial.len(), parallel.len(), "{what}: step counts");
    for (step, (a, b)) in serial.iter().zip(parallel).enumerate() {
        let rel = (a - b).abs() / a.abs();
        assert!(
            rel <= tolerance,
            "{what} step {step}: serial {a}, parallel {b} (rel {rel:e})"
        );
    }
}

/// Whether element `i` of parameter `name` (of `len` elements) is a key bias: the middle third
/// of a fused QKV bias. Softmax ignores a score shift shared by every key, and `q·(k + b)` shifts
/// every key's score by `q·b`, so the key bias's gradient is exactly zero; what the backend
/// computes is rounding noise (~1e-10), which AdamW, dividing by `√v`, turns into full-size
/// steps. Its values are noise in any run and differ with any reordering of sums, so they are
/// left out of the comparison (everything else is compared).
pub fn is_key_bias(name: &str, i: usize, len: usize) -> bool {
    name.ends_with("attn.c_attn.bias") && (len / 3..2 * len / 3).contains(&i)
}

/// The largest absolute difference between two runs' parameters (key biases aside, see
/// [`is_key_bias`]), and where it is.
pub fn max_param_difference(
    a: &BTreeMap<String, TensorData>,
    b: &BTreeMap<String, TensorData>,
) -> (f32, String) {
    max_scaled_difference(a, b, |_| 1.0)
}

/// The largest difference between two runs' parameters relative to the tensor's largest value
/// in `a` (key biases aside), and where it is.
pub fn max_relative_difference(
    a: &BTreeMap<String, TensorData>,
    b: &BTreeMap<String, TensorData>,
) -> (f32, String) {
    max_scaled_difference(a, b, |x| {
        x.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30)
    })
}

/// Whether `candidate` is a worse difference than `worst`: larger, or the first NaN (which then
/// stays the worst).
fn is_worse(candidate: f32, worst: f32) -> bool {
    match (candidate.is_nan(), worst.is_nan()) {
        (_, true) => false,
        (true, false) => true,
        (false, false) => candidate > worst,
    }
}

/// How many parameter elements (key biases aside) differ by more than `threshold` between two
/// runs, of how many.
pub fn count_differences_over(
    a: &BTreeMap<String, TensorData>,
    b: &BTreeMap<String, TensorData>,
    threshold: f32,
) -> (usize, usize) {
    let (mut over, mut total) = (0, 0);
    for (name, x) in a {
        let (x, y): (Vec<f32>, Vec<f32>) =
            (x.to_vec().expect("f32"), b[name].to_vec().expect("f32"));
        assert_same_length(x.len(), y.len());
        for (i, (p, q)) in x.iter().zip(&y).enumerate() {
            if !is_key_bias(name, i, x.len()) {
                total += 1;
                // A NaN on either side counts as over.
                over += usize::from(!within(f64::from((p - q).abs()), f64::from(threshold)));
            }
        }
    }
    (over, total)
}

/// The largest `|a − b| / scale(tensor of a)` over the parameters (which must be the same in
/// both, of the same lengths), key biases aside, and where it is; the first NaN, if any, is the
/// largest.
fn max_scaled_difference(
    a: &BTreeMap<String, TensorData>,
    b: &BTreeMap<String, TensorData>,
    scale: impl Fn(&[f32]) -> f32,
) -> (f32, String) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "the same parameters"
    );
    let mut worst = (0.0f32, String::new());
    for (name, x) in a {
        let (x, y): (Vec<f32>, Vec<f32>) =
            (x.to_vec().expect("f32"), b[name].to_vec().expect("f32"));
        assert_same_length(x.len(), y.len());
        let scale = scale(&x);
        for (i, (p, q)) in x.iter().zip(&y).enumerate() {
            if is_key_bias(name, i, x.len()) {
                continue;
            }
            let difference = (p - q).abs() / scale;
            if is_worse(difference, worst.0) {
                worst = (difference, format!("{name}[{i}]: {p} vs {q}"));
            }
        }
    }
    worst
}

/// Losses at every step within 1e-6 relative, parameters after every step within `tolerance`
/// (relative to each tensor's largest value; 0 asks for bitwise equality, losses included).
pub fn assert_same_training(reference: &Path, run: &Path, what: &str, tolerance: f32) {
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

/// `wildfire train` with the base arguments plus each case's flags fails before training (no
/// metrics written), saying the case's message.
pub fn assert_refused(name: &str, cases: &[(&[&str], &str)]) {
    for (flags, expected) in cases {
        let dir = run_dir(name);
        let mut args = base_args(&dir);
        args.extend(flags.iter().map(|s| s.to_string()));
        let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
        assert!(!out.status.success(), "{flags:?} succeeded");
        assert!(text(&out).contains(expected), "{flags:?}:\n{}", text(&out));
        assert!(
            !dir.join("metrics.jsonl").exists(),
            "{flags:?} wrote metrics"
        );
    }
}

/// The pid of the launcher's child whose environment says `RANK=rank`.
pub fn child_with_rank(launcher: u32, rank: usize) -> Option<u32> {
    let wanted = format!("RANK={rank}");
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let parent: u32 = stat.rsplit(") ").next()?.split(' ').nth(1)?.parse().ok()?;
            let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
            let has_rank = environ
                .split(|b| *b == 0)
                .any(|var| var == wanted.as_bytes());
            (parent == launcher && has_rank).then_some(pid)
        })
}

/// Starts `wildfire launch --nproc-per-node ranks -- wildfire <train_args>` with a 60 s
/// communication deadline, SIGKILLs rank `victim` once two steps are logged in `dir`, and
/// asserts that the job fails naming the victim well within the deadline (30 s): either the
/// launcher sees the SIGKILL first, or a peer fails first naming its lost rank.
pub fn assert_killed_rank_fails_the_job(
    dir: &Path,
    ranks: usize,
    port: u16,
    train_args: Vec<String>,
    victim: usize,
) {
    let mut args = launch_args(ranks, port);
    args.extend(train_args);
    let launcher = spawn_with_env(
        env!("CARGO_BIN_EXE_wildfire"),
        &args,
        &[("WILDFIRE_COMM_TIMEOUT", "60")],
    );
    let started = Instant::now();
    while records_if_any(dir) < 2 {
        assert!(started.elapsed() < LIMIT, "no progress");
        std::thread::sleep(Duration::from_millis(100));
    }
    let pid = child_with_rank(launcher.id(), victim).expect("the victim's process");
    // SAFETY: kill(2) on a pid read from /proc.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let killed = Instant::now();
    let out = finish(launcher, LIMIT);
    let waited = killed.elapsed();
    assert!(!out.status.success(), "{}", text(&out));
    let out = text(&out);
    let named = format!("rank {victim}");
    assert!(
        out.contains(&named)
            && (out.contains("SIGKILL") || out.contains(&format!("{named} is gone"))),
        "{out}"
    );
    assert!(
        waited < Duration::from_secs(30),
        "took {waited:?} after the kill"
    );
}

pub fn records_if_any(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .map(|t| t.lines().filter(|l| l.contains("\"train\"")).count())
        .unwrap_or(0)
}

/// The exit status of tests/python's checks when a module they need is missing: 77, the
/// "skipped" status of automake's test harness (Python itself exits 2 for a missing script or
/// bad arguments, which must fail the test).
const PYTHON_MODULE_MISSING: i32 = 77;

/// Runs tests/python/`script` with `args` (killed at [`LIMIT`]): its output, or why it cannot run
/// here (no python3, or a module the script needs is missing).
fn run_python(script: &str, args: &[&str]) -> Result<Output, String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(script);
    let child = KillOnDrop::spawn(
        Command::new("python3")
            .arg(path)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .map_err(|e| format!("python3 is not runnable ({e})"))?;
    let out = finish(child, LIMIT);
    match out.status.code() {
        Some(PYTHON_MODULE_MISSING) => Err(String::from_utf8_lossy(&out.stderr).trim().to_owned()),
        _ => Ok(out),
    }
}

/// [`run_python`] for a check a test does where it can: `None`, printed as a skip, when it cannot
/// run here, unless `WILDFIRE_REQUIRE_PYTHON_CHECKS` (comma-separated script names) names the
/// script; then that fails the test.
pub fn python(script: &str, args: &[&str]) -> Option<Output> {
    let missing = match run_python(script, args) {
        Ok(out) => return Some(out),
        Err(missing) => missing,
    };
    // CI installs TensorBoard and sets this, so there a missing reader fails instead of skipping.
    let required = std::env::var("WILDFIRE_REQUIRE_PYTHON_CHECKS").unwrap_or_default();
    assert!(
        !required.split(',').any(|s| s == script),
        "{script} is required here: {missing}"
    );
    println!("skipped: {script}: {missing}");
    None
}

/// [`run_python`] for the check a test exists for (the `#[ignore]`d comparisons with
/// transformers, which run only when asked for): that it cannot run fails the test.
pub fn python_required(script: &str, args: &[&str]) -> Output {
    run_python(script, args).unwrap_or_else(|missing| panic!("{script} cannot run: {missing}"))
}

/// Hugging Face transformers loads `export` (exported from the checkpoint in `checkpoint`) and
/// computes our logits of `prompt` at every position, within 1e-4 (the two sum in different
/// orders), and continues it greedily by `new` tokens as we do, token for token.
pub fn assert_transformers_computes_ours(
    checkpoint: &Path,
    export: &Path,
    prompt: &[u32],
    new: usize,
) {
    use burn::tensor::{Int, Tensor};
    use wildfire_recipes::generate::{Sampling, continue_tokens, load_model};

    let mut args = vec![export.to_str().unwrap().to_string(), new.to_string()];
    args.extend(prompt.iter().map(u32::to_string));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let check = python_required("check_hf_export.py", &args);
    assert!(check.status.success(), "transformers:\n{}", text(&check));
    let theirs: Value = serde_json::from_slice(&check.stdout).expect("logits JSON");
    let logits: Vec<Vec<f64>> = serde_json::from_value(theirs["logits"].clone()).unwrap();
    let greedy: Vec<u32> = serde_json::from_value(theirs["greedy"].clone()).unwrap();

    let device = Default::default();
    let (model, _, config) =
        load_model::<wildfire_recipes::CpuBackend>(checkpoint, &device).unwrap();
    let ids: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).collect();
    let input = TensorData::new(ids, [1, prompt.len()]);
    let input = Tensor::<wildfire_recipes::CpuBackend, 2, Int>::from_data(input, &device);
    let ours: Vec<f32> = model.forward(input).into_data().to_vec().unwrap();
    let ours: Vec<f64> = ours.iter().map(|&x| f64::from(x)).collect();
    let theirs: Vec<f64> = logits.concat();
    let worst = wildfire_backend::compare::max_abs_difference(&theirs, &ours);
    println!("logits against transformers: worst difference {worst:e}");
    assert!(worst < 1e-4, "logits {worst:e} apart");
    let sampling = Sampling {
        max_new_tokens: new,
        temperature: 0.0,
        top_k: None,
        seed: 0,
        kv_cache: true,
    };
    let vocab = logits[0].len();
    let continued = continue_tokens(&model, prompt.to_vec(), &sampling, config.context, vocab);
    assert_eq!(
        continued.unwrap()[prompt.len()..],
        greedy,
        "greedy continuation"
    );
}

/// Llama 3's pre-tokenisation pattern (its tokenizer.json's `Split` pre-tokenizer).
const LLAMA3_PIECES: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A `tokenizer.json` of Llama 3's design (its pre-tokenizer, byte-level BPE, its two document
/// tokens), trained by Hugging Face's `tokenizers` on the bundled corpus to `vocab` ids, written
/// to `dir/tokenizer.json`: the real Llama 3 file cannot be downloaded here.
pub fn llama3_style_tokenizer(dir: &Path, vocab: usize) -> PathBuf {
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::models::{ModelWrapper, TrainerWrapper};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::{
        AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
        SplitDelimiterBehavior, TokenizerBuilder, TokenizerImpl,
    };
    let pieces = Split::new(
        SplitPattern::Regex(LLAMA3_PIECES.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .unwrap();
    let pre = Sequence::new(vec![
        pieces.into(),
        ByteLevel::new(false, true, false).into(),
    ]);
    let mut tokenizer: TokenizerImpl<
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerBuilder::new()
        .with_model(BPE::default().into())
        .with_pre_tokenizer(Some(pre.into()))
        .with_decoder(Some(ByteLevel::default().into()))
        .build()
        .unwrap();
    let specials = ["<|begin_of_text|>", "<|end_of_text|>"];
    let trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(specials.map(|s| AddedToken::from(s, true)).to_vec())
        .build();
    let mut trainer = TrainerWrapper::BpeTrainer(trainer);
    tokenizer
        .train_from_files(&mut trainer, vec![CORPUS.to_string()])
        .unwrap();
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("tokenizer.json");
    tokenizer.save(&path, false).unwrap();
    path
}

/// The comparisons of two runs' parameters count or report a NaN as the worst difference, and
/// refuse tensors of different lengths.
#[test]
fn the_run_comparisons_fail_a_nan_and_refuse_a_short_result() {
    let params = |values: &[f32]| {
        BTreeMap::from([(
            "w".to_string(),
            TensorData::new(values.to_vec(), [values.len()]),
        )])
    };
    let good = params(&[1.0, 2.0, 3.0]);
    let nan = params(&[1.0, f32::NAN, 3.0]);
    assert_eq!(
        count_differences_over(&good, &params(&[1.0, 2.5, 3.0]), 1e-5),
        (1, 3)
    );
    assert_eq!(count_differences_over(&good, &nan, 1e-5), (1, 3));
    assert!(max_param_difference(&good, &nan).0.is_nan());
    assert!(max_param_difference(&nan, &good).0.is_nan());
    assert!(
        max_relative_difference(&good, &params(&[f32::NAN, 2.0, 9.0]))
            .0
            .is_nan()
    );
    assert_eq!(
        max_param_difference(&good, &params(&[1.0, 2.0, 3.5])).0,
        0.5
    );
    let short = params(&[1.0, 2.0]);
    let refused = |compare: &dyn Fn()| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(compare)).is_err()
    };
    assert!(refused(&|| {
        count_differences_over(&good, &short, 1e-5);
    }));
    assert!(refused(&|| drop(max_param_difference(&good, &short))));
    assert!(refused(&|| drop(max_relative_difference(&short, &good))));
    assert!(is_worse(f32::NAN, 1.0) && !is_worse(1.0, f32::NAN) && is_worse(2.0, 1.0));
}
