//! Helpers shared by the multi-rank tests of this crate.
#![allow(dead_code)]

use std::time::Duration;

use wildfire_backend::comm::{CommOptions, ProcessGroup, run_thread_ranks};

/// `n` pseudo-random values (xorshift from `seed`) in [−1, 1], or, `integer`, in {−3, …, 3}:
/// sums of a few integer values are exact in f32.
pub fn values(seed: u64, n: usize, integer: bool) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state % 2001) as f32 / 1000.0 - 1.0;
            if integer { (unit * 3.0).round() } else { unit }
        })
        .collect()
}

/// One thread world at a time: Burn 0.21's autodiff registry is shared by the threads of a
/// process, and a rank cleaning it up after a backward pass can block on a graph whose rank
/// waits in a collective (see `wildfire_backend::collective`); the tests of a file run in
/// parallel threads otherwise.
static ONE_WORLD: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `body` on every rank of a thread world (a collective waits 30 s at most, the world 5
/// minutes), then a barrier (thread ranks must meet between backward passes); the ranks'
/// results in rank order.
pub fn threads<T: Send + 'static>(
    ranks: usize,
    body: impl Fn(ProcessGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let _one = ONE_WORLD.lock().unwrap_or_else(|p| p.into_inner());
    let options = CommOptions {
        timeout: Duration::from_secs(30),
        debug: true,
    };
    run_thread_ranks(ranks, options, Duration::from_secs(300), move |group| {
        let out = body(group.clone());
        group.barrier().unwrap();
        out
    })
}

/// Every element of `a` within `tolerance × max|b|` of `b`'s.
pub fn assert_close(a: &[f32], b: &[f32], tolerance: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tolerance * scale,
            "{what}[{i}]: {x} vs {y} (tolerance {tolerance} × {scale})"
        );
    }
}
