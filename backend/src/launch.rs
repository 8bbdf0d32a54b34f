//! The process launcher behind `wildfire launch`: starts one process per local rank with
//! torchrun's variables, prefixes their output with the rank, and supervises them.
//!
//! - When a rank fails, the others are stopped (SIGTERM, then SIGKILL after a grace period) and
//!   the launch fails naming the rank, its exit status or signal, and its last line on stderr
//!   (in a job of several nodes, a node whose rank lost a peer on another node names it so).
//! - With `max_restarts`, this node's group is started again (`wildfire train --resume auto`
//!   ranks continue from their newest checkpoint); `WILDFIRE_RESTART_COUNT` tells them which
//!   attempt they are. A job of several nodes is restarted whole by its scheduler.
//! - Every rank gets the job's secret (`WILDFIRE_JOB_TOKEN`, see `comm::auth`): the launcher's
//!   own when it has one (every launcher of a multi-node job must, or it fails at once), else a
//!   new one for a single-node job.
//! - No process outlives the launcher: each rank runs in its own process group, which is killed
//!   on the way out, and the kernel kills a rank whose launcher dies (`PR_SET_PDEATHSIG`).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::comm::auth::{JOB_TOKEN_ENV, JobToken, secret_in_env};
use crate::comm::{BIND_ENV, DEFAULT_MASTER_PORT};

/// How to launch a job on this node.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchConfig {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// The address rank 0's store and every rank's listener bind (`WILDFIRE_BIND` for the
    /// ranks); `None` for `master_addr`'s and each rank's advertised one.
    pub bind: Option<std::net::IpAddr>,
    pub max_restarts: usize,
    /// How long ranks get to exit after SIGTERM before SIGKILL.
    pub grace: Duration,
    /// The program and its arguments.
    pub command: Vec<String>,
}

impl Default for LaunchConfig {
    fn default() -> Self {
        Self {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            bind: None,
            max_restarts: 0,
            grace: Duration::from_secs(5),
            command: Vec::new(),
        }
    }
}

/// Why a launch failed.
#[derive(Debug, Error)]
pub enum LaunchError {
    #[error("invalid launch: {0}")]
    Invalid(String),
    #[error("cannot start rank {rank} ({program:?}): {source}")]
    Spawn {
        rank: usize,
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("rank {rank} (pid {pid}) {status}{last_words}; stopped the other ranks{restarts}")]
    RankFailed {
        rank: usize,
        pid: u32,
        status: String,
        /// `, its last words: "…"`: the rank's last line on stderr (usually its error), or empty.
        last_words: String,
        restarts: String,
    },
    #[error("interrupted by signal {0}; stopped all ranks")]
    Interrupted(i32),
}

impl LaunchError {
    /// The exit code the launcher should end with.
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchError::Interrupted(signal) => 128 + signal,
            _ => 1,
        }
    }
}

impl LaunchConfig {
    /// Checks the numbers before anything starts.
    pub fn validate(&self) -> Result<(), LaunchError> {
        if self.nproc_per_node == 0 {
            return Err(LaunchError::Invalid(
                "--nproc-per-node must be at least 1, got 0".into(),
            ));
        }
        if self.nnodes == 0 {
            return Err(LaunchError::Invalid(
                "--nnodes must be at least 1, got 0".into(),
            ));
        }
        if self.node_rank >= self.nnodes {
            return Err(LaunchError::Invalid(format!(
                "--node-rank {} must be below --nnodes {}",
                self.node_rank, self.nnodes
            )));
        }
        if self.command.is_empty() {
            return Err(LaunchError::Invalid(
                "no command to launch: give it after `--`, e.g. `wildfire launch --nproc-per-node 2 -- wildfire train`".into(),
            ));
        }
        Ok(())
    }

    fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }
}

/// Set by the signal handler: the signal that asked the launcher to stop, or 0.
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop_signal(signal: libc::c_int) {
    STOP_SIGNAL.store(signal, Ordering::SeqCst);
}

const STOP_SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// Installs the stop handlers; returns the previous ones, for [`restore_signal_handlers`].
fn install_signal_handlers() -> Vec<libc::sighandler_t> {
    STOP_SIGNAL.store(0, Ordering::SeqCst);
    STOP_SIGNALS
        .iter()
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        .map(|&signal| unsafe {
            libc::signal(signal, on_stop_signal as *const () as libc::sighandler_t)
        })
        .collect()
}

/// Puts back the handlers the process had before `launch` (it may be a library caller's).
fn restore_signal_handlers(previous: Vec<libc::sighandler_t>) {
    for (&signal, handler) in STOP_SIGNALS.iter().zip(previous) {
        // SAFETY: restores a handler the process had installed before.
        unsafe {
            libc::signal(signal, handler);
        }
    }
}

struct Rank {
    rank: usize,
    child: Child,
    pumps: Vec<JoinHandle<()>>,
    waiter: Option<JoinHandle<()>>,
    /// Its last non-empty line on stderr so far.
    last_line: Arc<Mutex<Option<String>>>,
}

impl Rank {
    /// `, its last words: "…"` from its last line on stderr, or nothing.
    fn last_words(&self) -> String {
        let line = self.last_line.lock().unwrap_or_else(|p| p.into_inner());
        line.as_ref()
            .map(|line| format!(", its last words: {line:?}"))
            .unwrap_or_default()
    }
}

/// A rank's exit, reported by its waiter thread the moment it happens, so that the first failure
/// is the one named even when the others fail right after it.
struct Exit {
    rank: usize,
    pid: u32,
    status: std::io::Result<ExitStatus>,
}

/// Runs the job; returns once every rank exited successfully, or with the first failure.
pub fn launch(config: &LaunchConfig) -> Result<(), LaunchError> {
    config.validate()?;
    let token = job_token(config)?;
    let previous = install_signal_handlers();
    let result = run_attempts(config, &token);
    restore_signal_handlers(previous);
    result
}

/// The secret the ranks get: this launcher's [`JOB_TOKEN_ENV`], or a new one for a job of one
/// node (a job of several needs the same one on every node).
fn job_token(config: &LaunchConfig) -> Result<String, LaunchError> {
    match secret_in_env() {
        Some(token) => Ok(token),
        None if config.nnodes > 1 => Err(LaunchError::Invalid(format!(
            "a job of {} nodes needs a secret that every launcher shares: set {JOB_TOKEN_ENV} \
             to the same value on every node (e.g. export {JOB_TOKEN_ENV}=$(openssl rand -hex \
             32))",
            config.nnodes
        ))),
        None => JobToken::generate()
            .map_err(|e| LaunchError::Invalid(format!("cannot generate the job's secret: {e}"))),
    }
}

fn run_attempts(config: &LaunchConfig, token: &str) -> Result<(), LaunchError> {
    let mut attempt = 0;
    loop {
        let (exit_tx, exit_rx) = mpsc::channel();
        let mut ranks = spawn_all(config, attempt, token, &exit_tx)?;
        let outcome = supervise(&ranks, &exit_rx);
        stop_all(&mut ranks, config.grace);
        match outcome {
            Outcome::Success => return Ok(()),
            Outcome::Interrupted(signal) => return Err(LaunchError::Interrupted(signal)),
            Outcome::Failed { rank, pid, status } => {
                let last_words = (ranks.iter().find(|r| r.rank == rank))
                    .map(Rank::last_words)
                    .unwrap_or_default();
                if attempt < config.max_restarts {
                    attempt += 1;
                    eprintln!(
                        "[launch] rank {rank} (pid {pid}) {status}{last_words}; restarting all ranks (restart {attempt} of {})",
                        config.max_restarts
                    );
                    continue;
                }
                let restarts = if config.max_restarts > 0 {
                    format!(" (after {} restart(s), none left)", config.max_restarts)
                } else {
                    String::new()
                };
                return Err(LaunchError::RankFailed {
                    rank,
                    pid,
                    status,
                    last_words,
                    restarts,
                });
            }
        }
    }
}

enum Outcome {
    Success,
    Failed {
        rank: usize,
        pid: u32,
        status: String,
    },
    Interrupted(i32),
}

fn spawn_all(
    config: &LaunchConfig,
    attempt: usize,
    token: &str,
    exits: &mpsc::Sender<Exit>,
) -> Result<Vec<Rank>, LaunchError> {
    let mut ranks: Vec<Rank> = Vec::with_capacity(config.nproc_per_node);
    for local_rank in 0..config.nproc_per_node {
        let rank = config.node_rank * config.nproc_per_node + local_rank;
        match spawn_rank(config, rank, local_rank, attempt, token, exits) {
            Ok(r) => ranks.push(r),
            Err(e) => {
                stop_all(&mut ranks, config.grace);
                return Err(e);
            }
        }
    }
    Ok(ranks)
}

fn spawn_rank(
    config: &LaunchConfig,
    rank: usize,
    local_rank: usize,
    attempt: usize,
    token: &str,
    exits: &mpsc::Sender<Exit>,
) -> Result<Rank, LaunchError> {
    let mut command = Command::new(&config.command[0]);
    command
        .args(&config.command[1..])
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", local_rank.to_string())
        .env("WORLD_SIZE", config.world_size().to_string())
        .env("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string())
        .env("GROUP_RANK", config.node_rank.to_string())
        .env("MASTER_ADDR", &config.master_addr)
        .env("MASTER_PORT", config.master_port.to_string())
        .env("WILDFIRE_RESTART_COUNT", attempt.to_string())
        .env("TORCHELASTIC_RESTART_COUNT", attempt.to_string())
        .env(JOB_TOKEN_ENV, token)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(ip) = config.bind {
        command.env(BIND_ENV, ip.to_string());
    }
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: only async-signal-safe calls (setpgid, prctl, getppid) run between fork and exec.
    unsafe {
        command.pre_exec(move || {
            // Own process group, so that stopping a rank stops everything it started.
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Die with the launcher (the spawning thread is the main thread, which lives as long).
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher may have died before prctl took effect (it may itself be PID 1, in a
            // container, so compare with its pid rather than with 1).
            if libc::getppid() != launcher {
                return Err(std::io::Error::other("the launcher exited during start-up"));
            }
            Ok(())
        });
    }
    let mut child = command.spawn().map_err(|source| LaunchError::Spawn {
        rank,
        program: config.command[0].clone(),
        source,
    })?;
    let mut pumps = Vec::new();
    let last_line = Arc::new(Mutex::new(None));
    if let Some(out) = child.stdout.take() {
        pumps.push(pump(out, rank, None));
    }
    if let Some(err) = child.stderr.take() {
        pumps.push(pump(err, rank, Some(last_line.clone())));
    }
    let pid = child.id();
    let exits = exits.clone();
    let waiter = std::thread::spawn(move || {
        let status = wait_without_reaping(pid);
        let _ = exits.send(Exit { rank, pid, status });
    });
    Ok(Rank {
        rank,
        child,
        pumps,
        waiter: Some(waiter),
        last_line,
    })
}

/// Waits for a rank to exit but leaves it a zombie, so that its pid (and process group id)
/// cannot be reused until `stop_all` has signalled the group and reaped it.
fn wait_without_reaping(pid: u32) -> std::io::Result<ExitStatus> {
    loop {
        // SAFETY: waitid only writes the siginfo we pass.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let flags = libc::WEXITED | libc::WNOWAIT;
        // SAFETY: a valid pid and a valid siginfo pointer.
        if unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, flags) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: filled in by a successful waitid with WEXITED.
        let status = unsafe { info.si_status() };
        // Encode as wait(2) does: exit code in the high byte, or the signal (0x80: core dumped).
        let raw = match info.si_code {
            libc::CLD_EXITED => status << 8,
            libc::CLD_DUMPED => status | 0x80,
            _ => status,
        };
        return Ok(ExitStatus::from_raw(raw));
    }
}

/// Copies a rank's output line by line, each prefixed with `[rank N] `: its stderr (keeping its
/// last non-empty line in `last_line`) to the launcher's, its stdout (`last_line` is `None`) to
/// the launcher's.
fn pump(
    stream: impl Read + Send + 'static,
    rank: usize,
    last_line: Option<Arc<Mutex<Option<String>>>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let mut prefixed = format!("[rank {rank}] ").into_bytes();
                    prefixed.extend_from_slice(&line);
                    let _ = match &last_line {
                        Some(last_line) => {
                            let text = String::from_utf8_lossy(&line).trim().to_string();
                            if !text.is_empty() {
                                *last_line.lock().unwrap_or_else(|p| p.into_inner()) = Some(text);
                            }
                            std::io::stderr().lock().write_all(&prefixed)
                        }
                        None => std::io::stdout().lock().write_all(&prefixed),
                    };
                }
            }
        }
    })
}

/// Waits until all ranks succeed, one fails, or a stop signal arrives.
fn supervise(ranks: &[Rank], exits: &mpsc::Receiver<Exit>) -> Outcome {
    let mut succeeded = 0;
    while succeeded < ranks.len() {
        let signal = STOP_SIGNAL.load(Ordering::SeqCst);
        if signal != 0 {
            return Outcome::Interrupted(signal);
        }
        match exits.recv_timeout(Duration::from_millis(20)) {
            Ok(Exit {
                status: Ok(status), ..
            }) if status.success() => succeeded += 1,
            Ok(Exit { rank, pid, status }) => {
                let status = match status {
                    Ok(status) => describe_status(status),
                    Err(e) => format!("could not be waited for ({e})"),
                };
                return Outcome::Failed { rank, pid, status };
            }
            Err(_) => {}
        }
    }
    Outcome::Success
}

fn signal_group(pid: u32, signal: i32) {
    // SAFETY: kill(2) with a negative pid signals the process group the rank leads.
    unsafe {
        libc::kill(-(pid as libc::pid_t), signal);
    }
}

/// Stops every rank and everything it started, and reaps them.
fn stop_all(ranks: &mut [Rank], grace: Duration) {
    // Whole process groups, exited or not: a rank's children may outlive it. Exited ranks are
    // still unreaped zombies here, so their group ids cannot have been reused.
    for r in ranks.iter() {
        signal_group(r.child.id(), libc::SIGTERM);
        // A stopped rank (SIGSTOP, a debugger's) only acts on SIGTERM once it runs again.
        signal_group(r.child.id(), libc::SIGCONT);
    }
    let exited = |r: &Rank| r.waiter.as_ref().is_none_or(JoinHandle::is_finished);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && !ranks.iter().all(exited) {
        std::thread::sleep(Duration::from_millis(20));
    }
    for r in ranks.iter_mut() {
        signal_group(r.child.id(), libc::SIGKILL);
        let _ = r.child.wait();
        if let Some(waiter) = r.waiter.take() {
            let _ = waiter.join();
        }
    }
    // A process that left its rank's group (setsid, a daemon) may still hold the output pipes:
    // stop copying after a moment rather than wait for it.
    let deadline = Instant::now() + Duration::from_secs(2);
    for r in ranks.iter_mut() {
        for pump in r.pumps.drain(..) {
            while !pump.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if pump.is_finished() {
                let _ = pump.join();
            }
        }
    }
}

/// "exited with status 3" or "was killed by signal 9 (SIGKILL)".
pub fn describe_status(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exited with status {code}");
    }
    match status.signal() {
        Some(signal) => format!("was killed by signal {signal} ({})", signal_name(signal)),
        None => format!("ended with {status}"),
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGHUP => "SIGHUP",
        libc::SIGPIPE => "SIGPIPE",
        _ => "signal",
    }
}
