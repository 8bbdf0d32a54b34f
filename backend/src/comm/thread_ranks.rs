//! A world of ranks as threads of this process, for tests, examples and benchmarks: one call
//! runs a function on every rank and returns the results in rank order, within a hard limit.

use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use super::group::{CommOptions, ProcessGroup};

/// Runs `body` on every rank of a local world of `size` threads (collectives waiting
/// `options.timeout` at most); the results in rank order. A body that runs backward passes with
/// collectives ends with a barrier, so that no rank drops its autodiff graph while another is
/// still inside the same collectives' backward.
///
/// Panics, never hangs: naming a rank that panicked (with its message), or the ranks still
/// running once `limit` has passed (their threads are left behind).
pub fn run_thread_ranks<R, F>(size: usize, options: CommOptions, limit: Duration, body: F) -> Vec<R>
where
    R: Send + 'static,
    F: Fn(ProcessGroup) -> R + Send + Sync + 'static,
{
    let body = Arc::new(body);
    let world = ProcessGroup::local_world(size, options).expect("a local world of threads");
    let jobs = world.into_iter().map(|group| {
        let body = body.clone();
        move || body(group)
    });
    run_threads_within(jobs.collect(), limit)
}

/// Runs each of `jobs` on a thread of its own (job `i` is rank `i`); the results in rank order.
/// Panics, never hangs: naming a rank that panicked (with its message), or the ranks still
/// running once `limit` has passed (their threads are left behind).
pub fn run_threads_within<R, J>(jobs: Vec<J>, limit: Duration) -> Vec<R>
where
    R: Send + 'static,
    J: FnOnce() -> R + Send + 'static,
{
    let size = jobs.len();
    let (done, results) = mpsc::channel();
    for (rank, job) in jobs.into_iter().enumerate() {
        let done = done.clone();
        std::thread::spawn(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            let _ = done.send((rank, result));
        });
    }
    let deadline = Instant::now() + limit;
    let mut out: Vec<Option<R>> = (0..size).map(|_| None).collect();
    for _ in 0..size {
        let left = deadline.saturating_duration_since(Instant::now());
        match results.recv_timeout(left) {
            Ok((rank, Ok(result))) => out[rank] = Some(result),
            Ok((rank, Err(panic))) => panic!("rank {rank} panicked: {}", message(&*panic)),
            Err(_) => {
                let running: Vec<usize> = (0..size).filter(|&r| out[r].is_none()).collect();
                panic!("hard timeout: ranks {running:?} still running after {limit:?}");
            }
        }
    }
    out.into_iter()
        .map(|r| r.expect("every rank reported"))
        .collect()
}

fn message(panic: &(dyn std::any::Any + Send)) -> String {
    (panic.downcast_ref::<String>().cloned())
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> CommOptions {
        CommOptions {
            timeout: Duration::from_secs(5),
            debug: false,
        }
    }

    #[test]
    fn results_come_back_in_rank_order() {
        let ranks = run_thread_ranks(3, options(), Duration::from_secs(30), |g| g.rank() * 10);
        assert_eq!(ranks, [0, 10, 20]);
    }

    #[test]
    #[should_panic(expected = "rank 1 panicked: rank one fails")]
    fn a_panicking_rank_is_named_with_its_message() {
        run_thread_ranks(2, options(), Duration::from_secs(30), |g| {
            assert!(g.rank() != 1, "rank one fails");
        });
    }

    #[test]
    #[should_panic(expected = "hard timeout: ranks [0]")]
    fn a_rank_past_the_limit_is_named() {
        run_thread_ranks(2, options(), Duration::from_millis(300), |g| {
            if g.rank() == 0 {
                std::thread::sleep(Duration::from_secs(3));
            }
        });
    }
}
