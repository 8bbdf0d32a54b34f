#!/usr/bin/env bash
# GPU validation on an NVIDIA GPU. Builds with `--features cuda` (or, with
# WILDFIRE_GPU_BUNDLE=<folder>, runs the executables `scripts/gpu-bundle.sh` built on another
# machine, for GPU machines without Rust), then runs, in this order:
#   0. `wildfire train --device cuda` on GPT-2 124M, bf16, context 1024 (tokens/s and MFU against
#      the GPU's data-sheet peak, in its log lines), with the fused ops and with them decomposed,
#      then the same model in PyTorch, eager and torch.compile, bf16 autocast, same batch, where
#      PyTorch with CUDA is installed (benches/reference/train_tiny.py --model gpt2);
#   1. the CubeCL kernels' benchmark against Burn's own ops, in bf16, with the issue's targets
#      (attention forward+backward >= 400 TFLOP/s at head dim 128 and length 4096;
#      mixed-precision matmul >= 70% of the dense bf16 peak at 8192^3, the peak from
#      WILDFIRE_PEAK_BF16_TFLOPS, default 989 for H100/H200 SXM) and its output against Burn's;
#   2. comm-check at world size 1 and, with 2+ GPUs, one process per GPU over NCCL;
#   3. the kernels' tests on CUDA (f32, f16, bf16) and a GPT training step with them against
#      the decomposed ops;
#   4. the decorator and collective tests on CUDA tensors (ranks as threads, world 1 and 2).
# Each step is stopped after WILDFIRE_GPU_STEP_TIMEOUT seconds (default 120; training and
# torch.compile get twice that, so the whole check fits in about 8 minutes) and its output
# is kept in WILDFIRE_GPU_LOGS (default a new temporary folder). Prints a summary that says
# plainly what ran, what passed and what was skipped.
set -uo pipefail
cd "$(dirname "$0")/.."

bundle=${WILDFIRE_GPU_BUNDLE:-}
step_limit=${WILDFIRE_GPU_STEP_TIMEOUT:-120}
logs=${WILDFIRE_GPU_LOGS:-$(mktemp -d)}
mkdir -p "$logs"
summary=()
failed=0
note() { summary+=("$1"); }

# A bundled test executable, or the same test target through cargo (each crate has one, its files
# as modules: a filter `module::` picks one file's tests); libtest arguments follow.
cargo_test() { # package, test target, libtest arguments...
    local package=$1 target=$2
    shift 2
    if [ -n "$bundle" ]; then
        "$bundle/$target" "$@"
    else
        cargo test --release --features cuda -p "$package" --test "$target" -- "$@"
    fi
}
export -f cargo_test
export bundle

run() { # log name, description, command...
    local log="$logs/$1.log" name=$2 limit=${limit:-$step_limit}
    shift 2
    echo "== $name"
    timeout "$limit" bash -o pipefail -c '"$@" 2>&1 | tee "$0"' "$log" "$@"
    case $? in
        0) note "PASS  $name" ;;
        124) note "FAIL  $name: stopped after ${limit}s"; failed=1 ;;
        *) note "FAIL  $name"; failed=1 ;;
    esac
    # Skips left (a dtype, a GPU count) print "skipped: ..."; surface them in the summary.
    local skip
    while read -r skip; do
        note "SKIP  part of it: $skip"
    done < <(grep -o 'skipped:.*' "$log" | sort -u)
}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: skipped everything: no NVIDIA driver (nvidia-smi -L fails)"
    exit 0
fi
gpus=$(nvidia-smi -L | grep -c '^GPU ')
echo "gpu-check: $gpus GPU(s):"; nvidia-smi -L

# CubeCL (through cudarc) and the NCCL transport load NVRTC and NCCL by name at run time. Where
# the loader's cache lacks one (a toolkit outside ldconfig's folders, NCCL from pip's
# nvidia-nccl wheel), add the folder that holds it.
for lib in libnvrtc.so libnccl.so.2; do
    if ! ldconfig -p | grep -q "$lib"; then
        found=$(find /usr/local /opt /usr/lib -name "$lib*" -print -quit 2>/dev/null)
        if [ -n "$found" ]; then
            export LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            echo "gpu-check: $lib from $(dirname "$found")"
        fi
    fi
done
# CubeCL's CUDA compiler includes the toolkit's headers from CUDA_PATH, else /usr/local/cuda.
if [ -z "${CUDA_PATH:-}" ] && [ ! -d /usr/local/cuda ] && command -v nvcc >/dev/null; then
    CUDA_PATH=$(dirname "$(dirname "$(command -v nvcc)")")
    export CUDA_PATH
fi

if [ -n "$bundle" ]; then
    echo "gpu-check: executables from $bundle"
    bin_dir=$bundle
else
    limit=1800 run build "build (--features cuda)" cargo build --release --features cuda \
        -p wildfire-backend -p wildfire-recipes -p wildfire-tests -p wildfire-benches --tests --bins
    bin_dir=target/release
fi

# nvidia-smi has seen a GPU, so a CUDA device the tests cannot use is a failure, not a skip.
export WILDFIRE_REQUIRE_CUDA=1
# Autotuning only chooses among correct kernels; kept short, the whole check fits its minutes.
export CUBECL_AUTOTUNE_LEVEL=${CUBECL_AUTOTUNE_LEVEL:-minimal}

# GPT-2 124M on one GPU, bf16, context 1024, 8 sequences per step: wildfire, then PyTorch.
# Twice: with the fused ops (the default) and with them decomposed into Burn's ops, whose
# matmuls are Burn's autotuned tensor-core kernels (the fused attention is not tuned for GPUs).
batch=8
for fused in true false; do
    limit=$((2 * step_limit)) run "train-gpt2-fused-$fused" \
        "wildfire train --device cuda: GPT-2 124M, bf16, context 1024, batch $batch, fused ops $fused (tokens/s, MFU)" \
        "$bin_dir/wildfire" train --config recipes/configs/gpt2-124m.toml --device cuda \
        --precision bf16 --set train.max_steps=30 --set "train.micro_batch=$batch" \
        --set train.grad_accum=1 --set train.eval_every=0 --set checkpoint.every=0 \
        --set "train.fused_ops=$fused" --set run.log_every=5 \
        --set "run.dir=\"$logs/gpt2-run-fused-$fused\""
done
if python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    for mode in eager compile; do
        flags=(--threads 8 --model gpt2 --device cuda --batch "$batch" --bf16 --warmup 5 --steps 20)
        [ "$mode" = compile ] && flags+=(--compile)
        limit=$((2 * step_limit)) run "torch-$mode" \
            "PyTorch $mode, the same GPT-2 124M step (bf16 autocast)" \
            python3 benches/reference/train_tiny.py "${flags[@]}"
    done
else
    note "SKIP  PyTorch eager and torch.compile: no PyTorch with CUDA (pip install torch)"
fi

# The kernels on CUDA: their output against Burn's (the bench's `difference`, checked within a
# few units of bf16 roundoff) and the throughput targets. The attention kernels are not tuned
# for GPUs (no shared-memory tiles, no tensor cores), so its target is expected to miss; the
# matmul's product is Burn's autotuned CubeCL matmul.
run kernels-bench "CubeCL kernels on CUDA, bf16: agreement with Burn and throughput targets" \
    "$bin_dir/wildfire-benches" kernels --device cuda --dtype bf16 --batch 4 --heads 16 \
    --seq 4096 --head-dim 128 --matmul-size 8192 --rounds 2 --targets \
    --peak-tflops "${WILDFIRE_PEAK_BF16_TFLOPS:-989}"

run comm-check "comm-check, world size 1, CUDA tensors" "$bin_dir/wildfire" comm-check --device cuda
if [ "$gpus" -gt 1 ]; then
    run comm-check-nccl "comm-check, $gpus processes (one per GPU), CUDA tensors, tcp transport" \
        "$bin_dir/wildfire" launch --nproc-per-node "$gpus" --master-port 29555 -- \
        "$bin_dir/wildfire" comm-check --device cuda
else
    note "SKIP  multi-GPU comm-check and NCCL between ranks: only 1 GPU present (the one-rank NCCL probe ran)"
fi

# The kernels' correctness on CUDA, in f32, f16 and bf16 (bf16 is skipped on lavapipe): the
# attention's output and three gradients against decomposed attention at every tested shape,
# the matmul against f64 and bitwise on small integers, the fused bias + GELU and its gradients
# against f64.
for module in flash_attention mixed_matmul bias_gelu; do
    run "test-$module" "CubeCL kernel tests on CUDA: $module" \
        cargo_test wildfire-backend backend "$module::"
done
run test-fused-ops "a GPT training step on CUDA, fused ops against decomposed ones" \
    cargo_test wildfire-recipes recipes fused_ops::on_cuda

run test-gpu "decorator + collectives tests on CUDA tensors (ranks as threads, world 1 and 2)" \
    cargo_test wildfire-tests integration gpu:: --nocapture --test-threads 1

echo
echo "gpu-check summary (logs in $logs):"
printf '  %s\n' "${summary[@]}"
exit $failed
