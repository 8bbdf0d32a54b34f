//! Activation checkpointing lowers the peak memory of a step's forward and backward: the tiny
//! model (context 128, 16 sequences per micro-batch) trains 2 steps in this process under each
//! mode, which reports the peak heap growth of its forwards and backwards (`activation_peak_mib`)
//! from the counting allocator. One test in its own process, so no other test's allocations are
//! counted.

mod common;

use common::{CORPUS, run_dir, series};
use wildfire_recipes::alloc::CountingAlloc;
use wildfire_recipes::config::RunConfig;

#[global_allocator]
static HEAP: CountingAlloc = CountingAlloc::new();

/// The run's `activation_peak_mib` of its second step (the first also allocates AdamW's
/// moments) under `mode` (a value of `train.activation_checkpointing`), and its losses.
fn activation_peak(mode: &str) -> (f64, Vec<f64>) {
    let dir = run_dir(&format!("activation-memory-{mode}"));
    let overrides = [
        format!("run.dir={:?}", dir.display().to_string()),
        format!("data.path={CORPUS:?}"),
        "train.max_steps=2".into(),
        "train.eval_every=0".into(),
        "checkpoint.every=0".into(),
        "run.threads=1".into(),
        format!("train.activation_checkpointing={mode:?}"),
    ];
    let config = RunConfig::load(None, &overrides).expect("config");
    let outcome = wildfire_recipes::train::run_on_cpu(config, false).expect("training");
    (
        series(&dir, "train", "activation_peak_mib")[1],
        outcome.losses,
    )
}

/// Measured on the tiny model (`wildfire-benches activations`, fused attention): none ≈ 142 MiB,
/// full ≈ 49 MiB (0.35×), selective ≈ 82 MiB (0.58×). The bounds leave room for allocator and
/// thread-pool differences: full below 0.5× and selective below 0.7× of no checkpointing.
#[test]
fn checkpointing_lowers_the_peak_heap_of_forward_and_backward() {
    wildfire_recipes::alloc::register(&HEAP);
    let (none, losses) = activation_peak("none");
    for (mode, bound) in [("full", 0.5), ("selective", 0.7)] {
        let (peak, mode_losses) = activation_peak(mode);
        let ratio = peak / none;
        println!(
            "{mode}: forward+backward peak {peak:.1} MiB against {none:.1} MiB without \
             checkpointing ({ratio:.2}×)"
        );
        assert!(
            ratio < bound,
            "{mode}: {ratio:.2}× of the peak, bound {bound}"
        );
        assert_eq!(mode_losses, losses, "{mode}: losses");
    }
}
