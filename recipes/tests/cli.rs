//! The `wildfire` command line as a user runs it. (These tests also make `cargo test --workspace`
//! build the `wildfire` binary, which the multi-process tests in `tests/` launch.)

use std::process::Output;

use crate::common::{LIMIT, finish, spawn, spawn_with_env, wildfire_output as wildfire};

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn help_lists_the_commands() {
    let out = wildfire(&["--help"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        text.contains("launch") && text.contains("comm-check"),
        "{text}"
    );
}

#[test]
fn launch_rejects_bad_arguments_naming_the_values() {
    let out = wildfire(&["launch", "--nproc-per-node", "0", "--", "true"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--nproc-per-node must be at least 1, got 0"),
        "{}",
        stderr(&out)
    );
    let out = wildfire(&["launch", "--nnodes", "2", "--node-rank", "2", "--", "true"]);
    assert!(
        stderr(&out).contains("--node-rank 2 must be below --nnodes 2"),
        "{}",
        stderr(&out)
    );
    let out = wildfire(&["launch", "--", "/no/such/program"]);
    assert!(
        !out.status.success() && stderr(&out).contains("/no/such/program"),
        "{}",
        stderr(&out)
    );
    let out = wildfire(&["launch", "--nproc-per-node", "2"]);
    assert!(
        !out.status.success(),
        "a launch without a command must fail"
    );
}

#[test]
fn comm_check_runs_ranks_as_threads() {
    let args = ["comm-check", "--threads", "2", "--small"].map(str::to_string);
    let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    assert_eq!(text.matches("comm-check passed").count(), 2, "{text}");
}

#[test]
fn bad_comm_settings_are_named() {
    let args = ["comm-check", "--small"].map(str::to_string);
    let timeout = [("WILDFIRE_COMM_TIMEOUT", "soon")];
    let out = finish(
        spawn_with_env(env!("CARGO_BIN_EXE_wildfire"), &args, &timeout),
        LIMIT,
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("WILDFIRE_COMM_TIMEOUT=\"soon\""),
        "{}",
        stderr(&out)
    );
    let out = wildfire(&["comm-check", "--device", "tpu"]);
    assert!(
        stderr(&out).contains("--device \"tpu\": expected cpu or cuda"),
        "{}",
        stderr(&out)
    );
    let out = wildfire(&["comm-check", "--rank", "3", "--world-size", "2"]);
    assert!(
        stderr(&out).contains("rank 3 is not below the world size 2"),
        "{}",
        stderr(&out)
    );
}
