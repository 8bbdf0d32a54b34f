//! Helpers for wildfire's multi-rank tests: the `wildfire` binary and launched test binaries run
//! as real processes with a hard timeout, none outliving its test ([`KillOnDrop`]). (Ranks as
//! threads: `wildfire_backend::comm::run_thread_ranks`.)

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use wildfire_backend::comm::CommOptions;

/// Options with a short deadline, for tests.
pub fn options(timeout_secs: f64, debug: bool) -> CommOptions {
    CommOptions {
        timeout: Duration::from_secs_f64(timeout_secs),
        debug,
    }
}

/// The `wildfire` binary of this build. `cargo test --workspace` builds it because
/// `recipes/tests/cli.rs` is an integration test of its package; a `cargo build` from inside a
/// test is no option (cargo holds the build lock while tests run).
pub fn wildfire_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target directory");
    let bin = dir.join("wildfire");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build --release -p wildfire-recipes` (cargo test --workspace does)",
        bin.display()
    );
    bin
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .expect("bind an ephemeral port")
        .port()
}

/// What a finished command printed.
#[derive(Debug)]
pub struct Finished {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Finished {
    pub fn output(&self) -> String {
        format!("{}\n{}", self.stdout, self.stderr)
    }
}

/// A child process that cannot outlive its test: killed and reaped when the guard is dropped
/// before the process finished (a test that panics while its job runs), and killed by the kernel
/// when the thread that started it ends (`PR_SET_PDEATHSIG`), which the exit of the test process
/// ends too. A launcher's ranks die with the launcher (it sets the same signal for them).
#[derive(Debug)]
pub struct KillOnDrop(Option<Child>);

impl KillOnDrop {
    /// Starts `command` under the guard.
    pub fn spawn(command: &mut Command) -> std::io::Result<Self> {
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: only async-signal-safe calls (prctl, getppid, raise) run between fork and exec.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have ended before the signal was set.
                if libc::getppid() != parent {
                    libc::raise(libc::SIGKILL);
                }
                Ok(())
            })
        };
        command.spawn().map(|child| Self(Some(child)))
    }

    fn child(&mut self) -> &mut Child {
        self.0
            .as_mut()
            .expect("the process, until it is waited for")
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.0.as_ref().map_or(0, Child::id)
    }

    /// Its exit status if it has finished.
    pub fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        self.child().try_wait()
    }

    /// Kills it now.
    pub fn kill(&mut self) -> std::io::Result<()> {
        self.child().kill()
    }

    /// Takes its piped output stream (see [`Child::stdout`]).
    pub fn take_stdout(&mut self) -> Option<std::process::ChildStdout> {
        self.child().stdout.take()
    }

    /// Takes its piped error stream.
    pub fn take_stderr(&mut self) -> Option<std::process::ChildStderr> {
        self.child().stderr.take()
    }

    /// Waits for it to finish and returns what it printed to piped streams; the guard has
    /// nothing left to kill.
    pub fn wait_with_output(mut self) -> std::io::Result<Output> {
        self.0
            .take()
            .expect("not yet waited for")
            .wait_with_output()
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs a command; kills it and fails the test if it is not done within `limit`.
pub fn run_with_limit(command: &mut Command, limit: Duration) -> Finished {
    let started = Instant::now();
    let mut child = KillOnDrop::spawn(
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    )
    .expect("start command");
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let out = drain(Box::new(child.take_stdout().expect("stdout")));
    let err = drain(Box::new(child.take_stderr().expect("stderr")));
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return Finished {
                code: status.code(),
                stdout: out.join().expect("stdout"),
                stderr: err.join().expect("stderr"),
                elapsed: started.elapsed(),
            };
        }
        if started.elapsed() > limit {
            drop(child);
            panic!(
                "hard timeout: {command:?} still running after {limit:?}; output so far:\n{}\n{}",
                out.join().unwrap_or_default(),
                err.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `wildfire launch --nproc-per-node n --master-port <free> -- <command>`.
pub fn launch(n: usize, extra: &[&str], command: &[&str]) -> Command {
    let mut cmd = Command::new(wildfire_bin());
    cmd.args([
        "launch",
        "--nproc-per-node",
        &n.to_string(),
        "--master-port",
        &free_port().to_string(),
    ])
    .args(extra)
    .arg("--")
    .args(command);
    cmd
}

/// `wildfire launch` of `n` ranks, each running the ignored test `test` (its path in this test
/// binary, e.g. `tcp::rank_of_an_attacked_job`) of the running test binary alone: the ranks of
/// a job a test launches are `#[ignore]`d tests, which a normal run lists as ignored.
pub fn launch_test_ranks(n: usize, test: &str) -> Command {
    let binary = std::env::current_exe().expect("the test binary's path");
    let binary = binary.to_str().expect("a UTF-8 path");
    launch(
        n,
        &[],
        &[binary, test, "--exact", "--ignored", "--test-threads=1"],
    )
}

/// The variable `name`, which the test that launches this rank sets: a clear failure when the
/// rank test runs on its own (`--ignored`) rather than under that test's `wildfire launch`.
pub fn launched_var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: this is a rank of a job another test launches, not a test")
    })
}

/// The per-rank reports `{report}.rank-{r}.json` of a finished run of `ranks` processes (its
/// output in the panic message when one is missing).
pub fn rank_reports<T: serde::de::DeserializeOwned>(
    report: &std::path::Path,
    ranks: usize,
    finished: &Finished,
) -> Vec<T> {
    (0..ranks)
        .map(|rank| {
            let path = format!("{}.rank-{rank}.json", report.display());
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{path}: {e}\n{}", finished.output()));
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
        })
        .collect()
}

/// The largest difference between `a` and `b`, relative to the largest magnitude in `b`: NaN
/// when any value is NaN; differing lengths panic ([`wildfire_backend::compare`]).
pub use wildfire_backend::compare::relative_difference;

/// `values` as f64.
pub fn widened(values: &[f32]) -> Vec<f64> {
    values.iter().map(|&v| f64::from(v)).collect()
}

/// The small run of the examples' training loops (`wildfire_examples::{tensor_parallel,
/// pipeline}`): the MLP of width 32 with 2 hidden blocks, 10 steps of 16 points.
pub fn example_loop_run() -> wildfire_examples::mlp::LoopRun {
    wildfire_examples::mlp::LoopRun {
        shape: wildfire_examples::mlp::Shape {
            width: 32,
            blocks: 2,
        },
        seed: 3,
        batch: 16,
        steps: 10,
        lr: 1e-2,
        checkpoints: None,
    }
}

/// Whether a process exists (zombies included).
pub fn process_exists(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// A tiny deterministic training run, for checking that a backend changes nothing.
pub mod training {
    use burn::module::{Module, Param};
    use burn::nn::Linear;
    use burn::optim::{AdamConfig, GradientsParams, Optimizer};
    use burn::tensor::activation::relu;
    use burn::tensor::backend::{AutodiffBackend, Backend};
    use burn::tensor::{Tensor, TensorData};

    #[derive(Module, Debug)]
    struct Mlp<B: Backend> {
        hidden: Linear<B>,
        out: Linear<B>,
    }

    /// Deterministic, non-symmetric values (no global RNG: tests run in parallel).
    pub fn values(len: usize, salt: u32) -> Vec<f32> {
        (0..len as u32)
            .map(|i| (((i * 2_654_435_761u32) ^ salt) % 1000) as f32 / 1000.0 - 0.5)
            .collect()
    }

    fn linear<B: Backend>(d_in: usize, d_out: usize, salt: u32, device: &B::Device) -> Linear<B> {
        let weight = Tensor::from_data(
            TensorData::new(values(d_in * d_out, salt), [d_in, d_out]),
            device,
        );
        let bias = Tensor::from_data(TensorData::new(values(d_out, salt + 1), [d_out]), device);
        Linear {
            weight: Param::from_tensor(weight),
            bias: Some(Param::from_tensor(bias)),
        }
    }

    /// Five Adam steps of a small MLP on a fixed regression, from fixed weights (no global RNG:
    /// tests run in parallel); returns the bits of the trained parameters.
    pub fn mlp_training_bits<B: AutodiffBackend>() -> Vec<u32> {
        let device = Default::default();
        let mut model = Mlp::<B> {
            hidden: linear(8, 16, 7, &device),
            out: linear(16, 4, 11, &device),
        };
        let mut optim = AdamConfig::new().init();
        let x = Tensor::<B, 2>::from_data(TensorData::new(values(32 * 8, 3), [32, 8]), &device);
        let y = Tensor::<B, 2>::from_data(TensorData::new(values(32 * 4, 5), [32, 4]), &device);
        for _ in 0..5 {
            let prediction = model.out.forward(relu(model.hidden.forward(x.clone())));
            let loss = (prediction - y.clone()).powi_scalar(2).mean();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads);
        }
        [
            model.hidden.weight.val().into_data(),
            model.hidden.bias.expect("bias").val().into_data(),
            model.out.weight.val().into_data(),
        ]
        .into_iter()
        .flat_map(|d| {
            wildfire_backend::host_data::host_values::<f32>(d)
                .expect("f32")
                .into_iter()
                .map(f32::to_bits)
        })
        .collect()
    }
}
