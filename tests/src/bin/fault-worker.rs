//! A rank that misbehaves on purpose, for the fault tests (run under `wildfire launch`).
//!
//! `fault-worker MODE [DIR]`:
//! - `sleep-past-deadline`: rank 1 sleeps; the others all-reduce and must time out.
//! - `kill-self DIR`: every rank writes DIR/rank<r>.pid; rank 1 then SIGKILLs itself, the others sleep.
//! - `mismatch`: rank 1 broadcasts while the others all-reduce (run with WILDFIRE_COMM_DEBUG=1).
//! - `flaky`: rank 1 exits 3 on the first attempt; after a restart every rank all-reduces.
//! - `die-after-joining`: rank 1 SIGKILLs itself once the group is up; the others all-reduce.

use std::time::{Duration, Instant};

use burn::backend::Flex;
use burn::tensor::Tensor;
use wildfire_backend::comm::{CommOptions, LaunchEnv, LaunchFlags, ProcessGroup, ReduceOp};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map(String::as_str).unwrap_or("");
    let env = LaunchEnv::detect(&LaunchFlags::default()).expect("launch environment");
    let restart: usize = std::env::var("WILDFIRE_RESTART_COUNT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if mode == "flaky" && restart == 0 && env.rank == 1 {
        eprintln!("flaky: rank 1 fails on attempt 0");
        std::process::exit(3);
    }
    if mode == "kill-self" {
        kill_self(&env, &args[2]);
    }
    let world = ProcessGroup::init(&env, CommOptions::from_env().expect("options")).expect("init");
    if mode == "die-after-joining" && env.rank == 1 {
        // SAFETY: signals this very process.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
    let device = Default::default();
    let x = Tensor::<Flex, 1>::ones([4], &device);
    let started = Instant::now();
    let result = match (mode, env.rank) {
        ("sleep-past-deadline", 1) => {
            std::thread::sleep(Duration::from_secs(60));
            return;
        }
        ("mismatch", 1) => world.broadcast(x, 0).map(drop),
        _ => world.all_reduce(x, ReduceOp::Sum).map(drop),
    };
    match result {
        Ok(()) => println!(
            "fault-worker {mode}: rank {} ok (restart {restart})",
            env.rank
        ),
        Err(e) => {
            eprintln!(
                "fault-worker error after {} ms: {e}",
                started.elapsed().as_millis()
            );
            std::process::exit(3);
        }
    }
}

fn kill_self(env: &LaunchEnv, dir: &str) -> ! {
    let path = |r: usize| std::path::Path::new(dir).join(format!("rank{r}.pid"));
    std::fs::write(path(env.rank), std::process::id().to_string()).expect("write pid");
    if env.rank == 1 {
        while !(0..env.world_size).all(|r| path(r).exists()) {
            std::thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: signals this very process.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
    std::thread::sleep(Duration::from_secs(120));
    std::process::exit(0)
}
