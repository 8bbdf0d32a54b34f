//! Faults: peers that are too slow, that die, or that run a different collective. Each must
//! produce a clear error (never a hang), with a hard timeout on every test.

use std::process::Command;
use std::time::{Duration, Instant};

use wildfire_backend::comm::auth::JOB_TOKEN_ENV;
use wildfire_backend::comm::{
    CommError, CommOptions, HostTensor, LaunchEnv, LaunchFlags, ProcessGroup, ReduceOp,
    TRANSPORT_ENV, run_thread_ranks,
};
use wildfire_tests::{KillOnDrop, free_port, launch, options, process_exists, run_with_limit};

const LIMIT: Duration = Duration::from_secs(120);

fn ones() -> HostTensor<f32> {
    HostTensor::new(vec![1.0; 16], vec![16])
}

/// A rank that sleeps past the deadline: the others fail with a timeout naming it, within
/// deadline + 5 s.
#[test]
fn a_sleeping_rank_times_out_the_others_with_its_name() {
    let deadline = 1.0;
    let results = run_thread_ranks(3, options(deadline, false), LIMIT, |world| {
        if world.rank() == 2 {
            std::thread::sleep(Duration::from_secs(4));
            return None;
        }
        let started = Instant::now();
        let err = world
            .all_reduce_host(ones(), ReduceOp::Sum)
            .expect_err("must time out");
        Some((err, started.elapsed()))
    });
    for (rank, result) in results.into_iter().take(2).enumerate() {
        let (err, elapsed) = result.expect("ranks 0 and 1 report");
        assert!(
            elapsed < Duration::from_secs_f64(deadline + 5.0),
            "rank {rank} took {elapsed:?}"
        );
        match &err {
            CommError::Timeout { missing, seq, .. } => {
                assert_eq!(missing, &vec![2], "{err}");
                assert_eq!(*seq, 0);
            }
            other => panic!("rank {rank}: expected a timeout, got {other}"),
        }
        let text = err.to_string();
        assert!(
            text.contains("all_reduce #0") && text.contains("world (3 ranks)"),
            "{text}"
        );
    }
}

/// A rank whose thread dies: the others fail at once (not at the deadline). With two ranks the
/// survivor names the dead one; with three, a survivor may first notice the other survivor
/// leaving after its own error, so it names whichever left first.
#[test]
fn a_rank_that_dies_is_reported_lost_without_waiting_for_the_deadline() {
    for n in [2, 3] {
        let results = run_thread_ranks(n, options(60.0, false), LIMIT, |world| {
            if world.rank() == 1 {
                drop(world);
                return None;
            }
            let started = Instant::now();
            let err = world
                .all_reduce_host(ones(), ReduceOp::Sum)
                .expect_err("peer is gone");
            Some((err, started.elapsed()))
        });
        for (rank, result) in results.iter().enumerate().filter(|(r, _)| *r != 1) {
            let (err, elapsed) = result.as_ref().expect("report");
            assert!(*elapsed < Duration::from_secs(10), "{elapsed:?}");
            match err {
                CommError::PeerLost {
                    rank: gone,
                    missing,
                    ..
                } => {
                    let expected: &[usize] = if n == 2 { &[1] } else { &[0, 1] };
                    assert!(
                        expected.contains(gone) && missing.contains(gone),
                        "rank {rank}: {err}"
                    );
                }
                other => panic!("rank {rank}: expected a lost peer, got {other}"),
            }
        }
    }
}

/// Debug mode: ranks that issue different collectives fail naming the first rank that disagrees.
#[test]
fn debug_mode_names_the_rank_running_a_different_collective() {
    let errors = run_thread_ranks(4, options(10.0, true), LIMIT, |world| {
        if world.rank() == 2 {
            world.broadcast_host(ones(), 0).expect_err("mismatch")
        } else {
            world
                .all_reduce_host(ones(), ReduceOp::Sum)
                .expect_err("mismatch")
        }
    });
    for err in errors {
        match &err {
            CommError::Mismatch { rank, detail, .. } => {
                assert_eq!(*rank, 2, "{err}");
                assert!(
                    detail.contains("broadcast") && detail.contains("all_reduce"),
                    "{err}"
                );
            }
            other => panic!("expected a mismatch, got {other}"),
        }
    }
}

/// Debug mode also catches a shape mismatch before any data moves, and a dtype mismatch.
#[test]
fn debug_mode_checks_dtype_and_shape() {
    let errors = run_thread_ranks(2, options(10.0, true), LIMIT, |world| {
        let shape_err = world
            .all_reduce_host(
                HostTensor::new(vec![0.0f32; 3 + world.rank()], vec![3 + world.rank()]),
                ReduceOp::Sum,
            )
            .expect_err("shape");
        let dtype_err = if world.rank() == 0 {
            world
                .all_reduce_host(HostTensor::new(vec![0i64; 3], vec![3]), ReduceOp::Sum)
                .expect_err("dtype")
        } else {
            world
                .all_reduce_host(HostTensor::new(vec![0.0f32; 3], vec![3]), ReduceOp::Sum)
                .expect_err("dtype")
        };
        (shape_err.to_string(), dtype_err.to_string())
    });
    for (shape_err, dtype_err) in errors {
        assert!(
            shape_err.contains("rank 1 disagrees") && shape_err.contains("[4]"),
            "{shape_err}"
        );
        assert!(
            dtype_err.contains("rank 1 disagrees")
                && dtype_err.contains("I64")
                && dtype_err.contains("F32"),
            "{dtype_err}"
        );
    }
}

#[test]
fn unreachable_master_and_port_in_use_are_named() {
    let port = free_port();
    let env = |rank| {
        LaunchEnv::from_vars(
            &LaunchFlags {
                rank: Some(rank),
                world_size: Some(2),
                master_addr: Some("127.0.0.1".into()),
                master_port: Some(port),
                ..Default::default()
            },
            |_| None,
        )
        .expect("env")
    };
    let quick = CommOptions {
        timeout: Duration::from_millis(500),
        debug: false,
    };
    let started = Instant::now();
    let err = ProcessGroup::init(&env(1), quick.clone()).expect_err("nobody serves the store");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        err.to_string().contains(&format!("127.0.0.1:{port}")),
        "{err}"
    );

    let taken = std::net::TcpListener::bind(("0.0.0.0", port)).expect("hold the port");
    let err = ProcessGroup::init(&env(0), quick).expect_err("port in use");
    assert!(
        err.to_string()
            .contains(&format!("port {port} is already in use")),
        "{err}"
    );
    drop(taken);
}

/// Over TCP: a rank sleeping past WILDFIRE_COMM_TIMEOUT makes the others fail with the timeout
/// error naming it, within the deadline + 5 s; the launcher then stops everything.
#[test]
fn tcp_sleeping_rank_times_out_the_others() {
    let mut cmd = launch(
        3,
        &["--grace-secs", "1"],
        &[env!("CARGO_BIN_EXE_fault-worker"), "sleep-past-deadline"],
    );
    cmd.env("WILDFIRE_COMM_TIMEOUT", "2");
    cmd.env(TRANSPORT_ENV, "tcp");
    let done = run_with_limit(&mut cmd, LIMIT);
    let out = done.output();
    assert_ne!(done.code, Some(0), "{out}");
    assert!(
        out.contains("timed out after") && out.contains("rank(s) [1]"),
        "{out}"
    );
    let elapsed_ms = error_times_ms(&out);
    assert!(!elapsed_ms.is_empty(), "{out}");
    assert!(
        elapsed_ms.iter().all(|ms| *ms <= 7000),
        "{elapsed_ms:?}\n{out}"
    );
    assert!(out.contains("wildfire launch: rank"), "{out}");
}

/// A rank killed with SIGKILL: the launch fails naming it and its signal, and no process of the
/// job is left behind.
#[test]
fn sigkilled_rank_is_named_and_nothing_is_left_behind() {
    let dir = std::env::temp_dir().join(format!("wildfire-kill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("pid dir");
    let mut cmd = launch(
        3,
        &["--grace-secs", "2"],
        &[
            env!("CARGO_BIN_EXE_fault-worker"),
            "kill-self",
            dir.to_str().expect("utf8"),
        ],
    );
    let done = run_with_limit(&mut cmd, LIMIT);
    let out = done.output();
    assert_eq!(done.code, Some(1), "{out}");
    assert!(
        out.contains("rank 1") && out.contains("killed by signal 9 (SIGKILL)"),
        "{out}"
    );
    for rank in 0..3 {
        let pid: u32 = std::fs::read_to_string(dir.join(format!("rank{rank}.pid")))
            .expect("pid file")
            .trim()
            .parse()
            .expect("pid");
        assert!(
            !process_exists(pid),
            "rank {rank} (pid {pid}) outlived the launcher"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Debug mode over TCP names the rank that runs a different collective.
#[test]
fn tcp_debug_mode_names_the_mismatched_rank() {
    let mut cmd = launch(
        3,
        &["--grace-secs", "1"],
        &[env!("CARGO_BIN_EXE_fault-worker"), "mismatch"],
    );
    cmd.env("WILDFIRE_COMM_DEBUG", "1")
        .env("WILDFIRE_COMM_TIMEOUT", "20");
    cmd.env(TRANSPORT_ENV, "tcp");
    let done = run_with_limit(&mut cmd, LIMIT);
    let out = done.output();
    assert_ne!(done.code, Some(0), "{out}");
    assert!(
        out.contains("rank 1 disagrees") && out.contains("debug check"),
        "{out}"
    );
}

#[test]
fn launcher_restarts_the_group_and_names_a_failed_rank() {
    let mut cmd = launch(
        2,
        &["--max-restarts", "1"],
        &[env!("CARGO_BIN_EXE_fault-worker"), "flaky"],
    );
    let done = run_with_limit(&mut cmd, LIMIT);
    let out = done.output();
    assert_eq!(done.code, Some(0), "{out}");
    assert!(
        out.contains("restarting all ranks (restart 1 of 1)"),
        "{out}"
    );
    assert!(
        out.contains("[rank 0] fault-worker flaky: rank 0 ok (restart 1)"),
        "{out}"
    );

    let mut cmd = launch(2, &[], &[env!("CARGO_BIN_EXE_fault-worker"), "flaky"]);
    let done = run_with_limit(&mut cmd, LIMIT);
    assert_eq!(done.code, Some(1));
    assert!(
        done.stderr.contains("rank 1") && done.stderr.contains("exited with status 3"),
        "{}",
        done.stderr
    );
}

/// The milliseconds each `fault-worker error after N ms` line of `out` reports.
fn error_times_ms(out: &str) -> Vec<u128> {
    out.lines()
        .filter_map(|l| l.split("error after ").nth(1))
        .filter_map(|l| l.split(" ms").next()?.parse().ok())
        .collect()
}

/// Over shared memory, ranks started by hand (no launcher stops the survivors): a rank
/// SIGKILLed once the group is up makes the others' all-reduce fail naming it long before the
/// deadline, and nothing of the job is left in /dev/shm.
#[test]
fn shm_sigkilled_rank_is_named_by_the_others_and_leaves_no_segment() {
    let port = free_port().to_string();
    let ranks: Vec<_> = (0..3)
        .map(|rank: usize| {
            let mut worker = Command::new(env!("CARGO_BIN_EXE_fault-worker"));
            worker
                .arg("die-after-joining")
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .envs([("WORLD_SIZE", "3"), ("LOCAL_WORLD_SIZE", "3")])
                .envs([("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", &port)])
                .envs([(TRANSPORT_ENV, "shm"), ("WILDFIRE_COMM_TIMEOUT", "60")])
                .env_remove(JOB_TOKEN_ENV);
            std::thread::spawn(move || run_with_limit(&mut worker, LIMIT))
        })
        .collect();
    let done: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
    assert_eq!(
        done[1].code,
        None,
        "rank 1 dies by its signal: {}",
        done[1].output()
    );
    for rank in [0, 2] {
        let out = done[rank].output();
        assert_eq!(done[rank].code, Some(3), "rank {rank}: {out}");
        assert!(out.contains("rank 1 exited"), "rank {rank}: {out}");
        let times = error_times_ms(&out);
        assert!(
            !times.is_empty() && times.iter().all(|ms| *ms < 10_000),
            "rank {rank} noticed within 10 s of a 60 s deadline: {out}"
        );
    }
    let prefix = format!("wildfire-{port}-");
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "left in /dev/shm: {left:?}");
}

/// A process under [`KillOnDrop`] does not outlive its test: dropping the guard (a test that
/// panics unwinds it) kills and reaps it, and the end of the thread that started it kills it
/// too (what the exit of the test process does to every such thread).
#[test]
fn a_guarded_process_dies_with_its_guard_and_with_its_thread() {
    let sleeper = || {
        let mut sleep = Command::new("sleep");
        sleep.arg("60");
        KillOnDrop::spawn(&mut sleep).expect("start sleep")
    };
    let guard = sleeper();
    let pid = guard.id();
    assert!(process_exists(pid), "sleep {pid} started");
    drop(guard);
    assert!(!process_exists(pid), "sleep {pid} outlived its guard");

    let pid = std::thread::spawn(move || {
        let guard = sleeper();
        let pid = guard.id();
        // As if the thread ended without unwinding the guard.
        std::mem::forget(guard);
        pid
    })
    .join()
    .unwrap();
    let started = Instant::now();
    // Killed, it is a zombie until reaped: state `Z` in /proc/PID/stat.
    let state = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        stat.rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().next())
            .map(str::to_owned)
    };
    while state().as_deref() != Some("Z") {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "sleep {pid} outlived the thread that started it (state {:?})",
            state()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: waitpid on our own child, which has exited.
    unsafe { libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), 0) };
}
