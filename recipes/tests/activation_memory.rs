//! Activation checkpointing and the fused ops lower the peak memory of a step's forward and
//! backward: the tiny model (context 128, 16 sequences per micro-batch) trains 2 steps under each
//! checkpointing mode, and without checkpointing on the decomposed ops, each run reporting the
//! peak heap growth of its forwards and backwards (`activation_peak_mib`) from the `wildfire`
//! binary's counting allocator. Each run is a process of its own, so no other test's
//! allocations are counted.

use crate::common::{CORPUS, LIMIT, finish, run_dir, series, spawn, text};

/// The run's `activation_peak_mib` of its second step (the first also allocates AdamW's
/// moments) under `mode` (a value of `train.activation_checkpointing`) with the fused ops on or
/// off (`train.fused_ops`), and its losses.
fn activation_peak(mode: &str, fused_ops: bool) -> (f64, Vec<f64>) {
    let dir = run_dir(&format!("activation-memory-{mode}-{fused_ops}"));
    let mut args = vec!["train".to_string()];
    for setting in [
        format!("run.dir={:?}", dir.display().to_string()),
        format!("data.path={CORPUS:?}"),
        "train.max_steps=2".into(),
        "train.eval_every=0".into(),
        "checkpoint.every=0".into(),
        "run.threads=1".into(),
        format!("train.activation_checkpointing={mode:?}"),
        format!("train.fused_ops={fused_ops}"),
    ] {
        args.extend(["--set".to_string(), setting]);
    }
    let out = finish(spawn(env!("CARGO_BIN_EXE_wildfire"), &args), LIMIT);
    assert!(out.status.success(), "{}", text(&out));
    (
        series(&dir, "train", "activation_peak_mib")[1],
        series(&dir, "train", "loss"),
    )
}

/// The checkpointing modes, then the fused ops, in one test: both compare with the same run
/// without checkpointing.
#[test]
fn checkpointing_and_the_fused_ops_lower_the_peak_heap_of_forward_and_backward() {
    let none = checkpointing_lowers_the_peak();
    the_fused_ops_keep_less_than_the_decomposed_ones(none);
}

/// Measured on the tiny model (fused attention on the packed QKV projection, fused bias + GELU
/// and fused LayerNorm, as native code on Flex): none ≈ 69.5 MiB, full ≈ 24.6 MiB (0.35×),
/// selective ≈ 61.5 MiB (0.88×). Selective checkpointing recomputes Burn's memory-bound ops,
/// and the fused ops leave few of them: before the MLP's bias + GELU was fused, none was
/// ≈ 142 MiB (the decomposed graph kept five tensors of the hidden's size, most of what
/// selective recomputed), and before LayerNorm was fused none was ≈ 85 MiB and selective
/// 0.77× of it. The bounds leave room for allocator and thread-pool differences (the peaks
/// repeat to within 0.1 MiB here): full below 0.55× and selective below 0.9× of no
/// checkpointing.
///
/// Returns none's peak and losses.
fn checkpointing_lowers_the_peak() -> (f64, Vec<f64>) {
    let (none, losses) = activation_peak("none", true);
    for (mode, bound) in [("full", 0.55), ("selective", 0.9)] {
        let (peak, mode_losses) = activation_peak(mode, true);
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
    (none, losses)
}

/// Measured on the tiny model: the fused ops (attention, the MLP's bias + GELU and LayerNorm)
/// hold the peak to ≈ 69.5 MiB against ≈ 190 MiB on the decomposed ops (0.37×; 0.45× before
/// LayerNorm was fused); asserted below 0.7×. The
/// losses agree within 1e-5 relative (the two sum the same terms in other orders).
fn the_fused_ops_keep_less_than_the_decomposed_ones((fused, fused_losses): (f64, Vec<f64>)) {
    let (decomposed, losses) = activation_peak("none", false);
    let ratio = fused / decomposed;
    println!(
        "fused ops: forward+backward peak {fused:.1} MiB against {decomposed:.1} MiB on the \
         decomposed ops ({ratio:.2}×)"
    );
    assert!(
        ratio < 0.7,
        "fused ops: {ratio:.2}× of the decomposed ops' peak, bound 0.7"
    );
    for (step, (a, b)) in fused_losses.iter().zip(&losses).enumerate() {
        assert!(
            ((a - b) / b).abs() < 1e-5,
            "step {step}: loss {a} with the fused ops, {b} with the decomposed ones"
        );
    }
}
