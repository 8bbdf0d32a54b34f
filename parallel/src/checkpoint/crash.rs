//! Crash points: where a test of crash safety makes a rank die in the middle of a checkpoint
//! write, as a power cut or an out-of-memory kill would.
//!
//! `WILDFIRE_CRASH_AT=POINT:STEP:RANK` makes rank `RANK` SIGKILL its own process when its
//! checkpoint of step `STEP` reaches `POINT`:
//! - `before-shard`: before it writes its shard file (other ranks may have written theirs);
//! - `before-commit`: rank 0, once every shard file is written, before the manifest and the
//!   commit marker.
//!
//! Only the first attempt of a job crashes (`WILDFIRE_RESTART_COUNT` unset or 0), so the restart
//! that `wildfire launch --max-restarts` makes runs through.

/// The environment variable naming the crash point.
pub const CRASH_ENV: &str = "WILDFIRE_CRASH_AT";

/// A place in a checkpoint write where a rank can be made to die.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashPoint {
    BeforeShard,
    BeforeCommit,
}

impl CrashPoint {
    fn name(self) -> &'static str {
        match self {
            CrashPoint::BeforeShard => "before-shard",
            CrashPoint::BeforeCommit => "before-commit",
        }
    }
}

/// SIGKILLs this process if [`CRASH_ENV`] names `point` of step `step` on rank `rank` (on the
/// job's first attempt). A malformed value is reported (at each checkpoint) and ignored.
pub fn crash_point(point: CrashPoint, step: u64, rank: usize) {
    let Ok(spec) = std::env::var(CRASH_ENV) else {
        return;
    };
    let attempt = std::env::var("WILDFIRE_RESTART_COUNT").unwrap_or_default();
    if !(attempt.is_empty() || attempt == "0") {
        return;
    }
    let fields: Vec<&str> = spec.split(':').collect();
    let known = |name: &str| {
        [CrashPoint::BeforeShard, CrashPoint::BeforeCommit]
            .iter()
            .any(|p| p.name() == name)
    };
    let parsed = match fields[..] {
        [name, at, on] if known(name) => {
            (at.parse::<u64>().ok().zip(on.parse::<usize>().ok())).map(|p| (name, p))
        }
        _ => None,
    };
    let Some((name, (at, on))) = parsed else {
        eprintln!(
            "warning: {CRASH_ENV}={spec} is not POINT:STEP:RANK with POINT before-shard or \
             before-commit; no crash point is set"
        );
        return;
    };
    if name == point.name() && at == step && on == rank {
        eprintln!("{CRASH_ENV}: rank {rank} dies {name} of the checkpoint of step {step}");
        // SAFETY: kill(2) on this process's own pid.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}
