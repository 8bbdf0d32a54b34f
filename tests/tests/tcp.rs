//! The collectives over the TCP transport, with real processes started by `wildfire launch`:
//! the same rank-stamped exactness checks as the thread tests, at 2 and 4 processes; and a
//! rendezvous that clients without the job's secret, garbage and idle connections do not stop.

use std::io::Write;
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use wildfire_backend::comm::auth::{JOB_TOKEN_ENV, JobToken};
use wildfire_backend::comm::{
    HostTensor, LaunchEnv, LaunchFlags, ProcessGroup, ReduceOp, StoreClient,
};
use wildfire_tests::{free_port, launch, options, run_with_limit, wildfire_bin};

fn comm_check(n: usize) {
    let bin = wildfire_bin();
    let mut cmd = launch(n, &[], &[bin.to_str().expect("utf8 path"), "comm-check"]);
    cmd.env("WILDFIRE_COMM_TIMEOUT", "120");
    let done = run_with_limit(&mut cmd, Duration::from_secs(300));
    let out = done.output();
    assert_eq!(done.code, Some(0), "{out}");
    for rank in 0..n {
        let line = format!(
            "[rank {rank}] comm-check passed: rank {rank} of {n} (tcp transport, cpu tensors)"
        );
        assert!(out.contains(&line), "missing {line:?} in\n{out}");
    }
}

#[test]
fn every_op_is_exact_over_tcp_with_two_processes() {
    comm_check(2);
}

#[test]
fn every_op_is_exact_over_tcp_with_four_processes() {
    comm_check(4);
}

/// Under `wildfire launch` (`WILDFIRE_ATTACKED` set to a file's path): one rank of a job that,
/// after its rendezvous, waits for that file before it all-reduces. Run alone, it does nothing.
#[test]
fn rank_of_an_attacked_job() {
    let Ok(attacks_done) = std::env::var("WILDFIRE_ATTACKED") else {
        return;
    };
    let env = LaunchEnv::detect(&LaunchFlags::default()).unwrap();
    let group = ProcessGroup::init(&env, options(60.0, false)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !Path::new(&attacks_done).exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let sum = group
        .all_reduce_host(HostTensor::new(vec![1.0f32], vec![1]), ReduceOp::Sum)
        .unwrap();
    assert_eq!(sum.data, [2.0]);
    println!("rank {} went on", group.rank());
}

#[test]
fn a_job_goes_on_past_clients_without_its_secret_garbage_idle_connections_and_a_burst() {
    let port = free_port();
    let attacks_done = std::env::temp_dir().join(format!("wildfire-attacked-{port}"));
    let _ = std::fs::remove_file(&attacks_done);
    let test_binary = std::env::current_exe().unwrap();
    let mut job = Command::new(wildfire_bin());
    job.args(["launch", "--nproc-per-node", "2", "--master-port"])
        .arg(port.to_string())
        .arg("--")
        .arg(&test_binary)
        .args(["tcp::rank_of_an_attacked_job", "--exact", "--nocapture"])
        .env("WILDFIRE_ATTACKED", &attacks_done)
        .env_remove(JOB_TOKEN_ENV);
    let job = std::thread::spawn(move || run_with_limit(&mut job, Duration::from_secs(120)));

    let store = ("127.0.0.1", port);
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(store).is_err() {
        assert!(Instant::now() < deadline, "the store never came up");
        std::thread::sleep(Duration::from_millis(20));
    }
    let idle = TcpStream::connect(store).unwrap();
    let burst: Vec<_> = (0..40)
        .filter_map(|_| TcpStream::connect(store).ok())
        .collect();
    let mut garbage = TcpStream::connect(store).unwrap();
    garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    drop(garbage);
    let timeout = Duration::from_secs(5);
    for guess in [JobToken::new("a guess"), JobToken::default()] {
        let error = StoreClient::connect("127.0.0.1", port, timeout, &guess).unwrap_err();
        assert!(
            error.to_string().contains("refused this rank's handshake"),
            "{error}"
        );
    }
    drop(burst);
    std::fs::write(&attacks_done, b"done").unwrap();
    let finished = job.join().unwrap();
    drop(idle);
    let _ = std::fs::remove_file(&attacks_done);
    let out = finished.output();
    assert_eq!(finished.code, Some(0), "{out}");
    for rank in 0..2 {
        assert!(out.contains(&format!("rank {rank} went on")), "{out}");
    }
    let refusals = out
        .matches("wildfire: refused a connection from 127.0.0.1")
        .count();
    assert!(
        refusals >= 3,
        "the secret-less clients and the garbage are logged:\n{out}"
    );
    assert!(
        out.contains(JOB_TOKEN_ENV),
        "a refusal names the secret:\n{out}"
    );
}

#[test]
fn a_multi_node_launch_without_a_shared_secret_fails_at_once_naming_it() {
    let mut launcher = Command::new(wildfire_bin());
    launcher
        .args([
            "launch",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-port",
        ])
        .arg(free_port().to_string())
        .args(["--", "true"])
        .env_remove(JOB_TOKEN_ENV);
    let finished = run_with_limit(&mut launcher, Duration::from_secs(30));
    let out = finished.output();
    assert_ne!(finished.code, Some(0), "{out}");
    assert!(out.contains(JOB_TOKEN_ENV), "{out}");
    assert!(finished.elapsed < Duration::from_secs(5), "{out}");
}
