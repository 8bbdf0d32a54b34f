//! The collectives over the TCP transport, with real processes started by `wildfire launch`:
//! the same rank-stamped exactness checks as the thread tests, at 2 and 4 processes.

use std::time::Duration;

use wildfire_tests::{launch, run_with_limit, wildfire_bin};

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
