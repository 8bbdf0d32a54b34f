#!/usr/bin/env bash
# GPU validation on an NVIDIA GPU. Builds with `--features cuda` (or, with
# WILDFIRE_GPU_BUNDLE=<folder>, runs the executables `scripts/gpu-bundle.sh` built on another
# machine, for GPU machines without Rust), then runs its steps in priority order:
#
#   speed         `wildfire train --device cuda` on GPT-2 124M, bf16, context 1024, batch 8, with
#                 the device's default fused ops, then the same model in PyTorch, eager and
#                 torch.compile, bf16 autocast, same batch, where PyTorch with CUDA is installed
#                 (benches/reference/train_tiny.py --model gpt2). Its table (scripts/gpu-summary.py)
#                 gives the first step (compiling and autotuning) apart from the steady step.
#   profile       `wildfire train --profile 3` on the same GPT-2 step (each step's table of kernels,
#                 its time outside them, its blocking reads), beside torch.profiler's table of the
#                 PyTorch eager step (benches/reference/train_tiny.py --profile 2).
#   kernel-tests  the CubeCL kernels' tests on CUDA (f32, f16, bf16), cuBLASLt's GEMM (the
#                 matmuls' vendor tier, off by default) against f64, the kernels queued in Burn's
#                 fusion stream against the bare backend, and a GPT training step with the kernels
#                 against the decomposed ops: what must pass before a kernel is turned on on CUDA.
#   kernels       the kernels' benchmark against Burn's ops in bf16 on the fused backend
#                 (attention target >= 400 TFLOP/s forward+backward at head dim 128, length 4096;
#                 mixed-precision matmul >= 70% of WILDFIRE_PEAK_BF16_TFLOPS, default 989), with
#                 cuBLASLt against Burn's CubeCL matmul at 8192³ and GPT-2's and Llama 3 8B's GEMM
#                 shapes, then PyTorch's numbers at the same shapes (benches/reference/kernels_torch.py).
#   fused-all     the speed run again with every fused op on (train.fused_ops=true), to see
#                 what the ops that are off by default on CUDA would change.
#   comm          comm-check at world size 1 (and one process per GPU over NCCL with 2+ GPUs),
#                 then the decorator and collective tests on CUDA tensors, bare and fused.
#
#   scripts/gpu-check.sh [--only step,step...]     (default: every step, in the order above)
#
# Burn's autotune results and CubeCL's compiled PTX are cached in WILDFIRE_GPU_LOGS/cubecl-cache
# (a `cubecl.toml` this script writes at the repository root, unless one is there), so a later
# run that starts from that folder (WILDFIRE_GPU_CACHE=<a previous cubecl-cache>) skips the
# tuning and the compiling. Each step's commands are stopped after WILDFIRE_GPU_STEP_TIMEOUT
# seconds (default 120; training and torch.compile get twice that), so the whole default run fits
# in about 8 minutes, tuning included. Output is kept in WILDFIRE_GPU_LOGS (default a new
# temporary folder). Prints a summary that says plainly what ran, passed and was skipped, and
# the speed table last.
set -uo pipefail
cd "$(dirname "$0")/.."

all_steps="speed profile kernel-tests kernels fused-all comm"
steps=$all_steps
if [ "${1:-}" = "--only" ]; then
    steps=${2:?"--only needs a comma-separated list of steps: ${all_steps// /, }"}
    steps=${steps//,/ }
    for step in $steps; do
        case " $all_steps " in
            *" $step "*) ;;
            *) echo "gpu-check: unknown step $step (steps: ${all_steps// /, })" >&2; exit 2 ;;
        esac
    done
elif [ $# -gt 0 ]; then
    echo "usage: scripts/gpu-check.sh [--only step,step...] (steps: ${all_steps// /, })" >&2
    exit 2
fi
wanted() { case " $steps " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

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
echo "gpu-check: $gpus GPU(s), steps: $steps"; nvidia-smi -L

# CubeCL (through cudarc), the NCCL transport and the matmuls' cuBLASLt tier load NVRTC, NCCL
# and cuBLASLt by name at run time. Where the loader's cache lacks one (a toolkit outside
# ldconfig's folders, pip's nvidia-* wheels), add the folder that holds it; where that folder
# has only a versioned name (libcublasLt.so.12 in a wheel), link the plain name to it in a
# folder of the check's own.
links="$logs/lib"
mkdir -p "$links"
python_sites=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)
for lib in libnvrtc.so libnccl.so.2 libcublasLt.so; do
    if ! ldconfig -p | grep -q "$lib"; then
        # shellcheck disable=SC2086
        found=$(find /usr/local /opt /usr/lib $python_sites -name "$lib*" -print -quit 2>/dev/null)
        if [ -n "$found" ]; then
            export LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            echo "gpu-check: $lib from $(dirname "$found")"
            if [ ! -e "$(dirname "$found")/$lib" ]; then
                ln -sf "$found" "$links/$lib"
                export LD_LIBRARY_PATH="$links:$LD_LIBRARY_PATH"
            fi
        fi
    fi
done
# CubeCL's CUDA compiler includes the toolkit's headers from CUDA_PATH, else /usr/local/cuda.
if [ -z "${CUDA_PATH:-}" ] && [ ! -d /usr/local/cuda ] && command -v nvcc >/dev/null; then
    CUDA_PATH=$(dirname "$(dirname "$(command -v nvcc)")")
    export CUDA_PATH
fi

# Burn's autotune results and CubeCL's PTX, kept with the logs for the next run to start from.
cache="$logs/cubecl-cache"
mkdir -p "$cache"
if [ -n "${WILDFIRE_GPU_CACHE:-}" ] && [ -d "$WILDFIRE_GPU_CACHE" ]; then
    cp -r "$WILDFIRE_GPU_CACHE/." "$cache/"
    echo "gpu-check: autotune and PTX caches from $WILDFIRE_GPU_CACHE"
fi
if [ ! -e cubecl.toml ]; then
    cat >cubecl.toml <<EOF
# Written by scripts/gpu-check.sh: Burn's autotune results and CubeCL's compiled kernels are kept
# in the check's log folder.
[autotune]
level = "${CUBECL_AUTOTUNE_LEVEL:-balanced}"
cache = { file = "$cache" }

[compilation]
cache = { file = "$cache" }
EOF
    trap 'rm -f cubecl.toml' EXIT
else
    echo "gpu-check: using the cubecl.toml already here; caches go where it says"
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

# GPT-2 124M on one GPU, bf16, context 1024, 8 sequences per step; `extra` settings after. The
# loop reads each step's loss and norm back at its end (run.log_every=1), so every step has its
# own time, as PyTorch's reference synchronises after each of its steps.
batch=8
train_gpt2() { # run name, description, extra --set arguments...
    local name=$1 description=$2
    shift 2
    limit=$((2 * step_limit)) run "train-$name" "$description" \
        "$bin_dir/wildfire" train --config recipes/configs/gpt2-124m.toml --device cuda \
        --precision bf16 --set train.max_steps=30 --set "train.micro_batch=$batch" \
        --set train.grad_accum=1 --set train.eval_every=0 --set checkpoint.every=0 \
        --set run.log_every=1 --set "run.dir=\"$logs/gpt2-run-$name\"" "$@"
}

if wanted speed; then
    train_gpt2 defaults \
        "wildfire train --device cuda: GPT-2 124M, bf16, context 1024, batch $batch, the device's default fused ops"
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
fi

if wanted profile; then
    train_gpt2 profile "the same GPT-2 step profiled: a table of kernels per step (--profile 3)" \
        --set train.max_steps=4 --profile 3
    if python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        limit=$((2 * step_limit)) run profile-torch "torch.profiler's table of the PyTorch eager step" \
            python3 benches/reference/train_tiny.py --threads 8 --model gpt2 --device cuda \
            --batch "$batch" --bf16 --warmup 3 --steps 2 --profile 2
    else
        note "SKIP  torch.profiler's table: no PyTorch with CUDA (pip install torch)"
    fi
fi

if wanted kernel-tests; then
    # Each kernel against f64 or decomposed attention in f32, f16 and bf16 (bf16 is skipped on
    # lavapipe), the kernels queued in the fusion stream against the bare backend, the fused
    # cross-entropy against the decomposed loss (off on CUDA until this passes), and a GPT
    # training step with the kernels against the decomposed ops.
    for module in flash_attention mixed_matmul cublaslt bias_gelu layer_norm rope swiglu adamw fusion \
        cross_entropy; do
        run "test-$module" "CubeCL kernel tests on CUDA: $module" \
            cargo_test wildfire-backend backend "$module::"
    done
    run test-fused-ops "a GPT training step on CUDA, fused ops against decomposed ones" \
        cargo_test wildfire-recipes recipes fused_ops::on_cuda
fi

if wanted kernels; then
    # Output against Burn's (the bench's `difference`, within a few units of bf16 roundoff) and
    # the throughput targets. The attention kernels have no tensor cores, so that target is
    # expected to miss.
    # With --gemm-shapes, cuBLASLt (the vendor tier) against Burn's CubeCL matmul at 8192³ and
    # GPT-2's and Llama 3 8B's GEMM shapes, then PyTorch's torch.matmul at the same shapes.
    run kernels-bench "CubeCL kernels on CUDA (fused backend), bf16: agreement with Burn and targets" \
        "$bin_dir/wildfire-benches" kernels --device cuda --dtype bf16 --batch 4 --heads 16 \
        --seq 4096 --head-dim 128 --matmul-size 8192 --rounds 2 --gemm-shapes --targets \
        --peak-tflops "${WILDFIRE_PEAK_BF16_TFLOPS:-989}"
    if python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        run kernels-torch "PyTorch's attention and torch.matmul at the same shapes, bf16" \
            python3 benches/reference/kernels_torch.py --batch 4 --heads 16 --seq 4096 \
            --head-dim 128 --matmul-size 8192 --rounds 5 --gemm-shapes
    else
        note "SKIP  PyTorch's kernels at the same shapes: no PyTorch with CUDA (pip install torch)"
    fi
fi

if wanted fused-all; then
    train_gpt2 all-fused "the same GPT-2 step with every fused op on (train.fused_ops=true)" \
        --set train.fused_ops=true
fi

if wanted comm; then
    # With a backtrace: an earlier check saw it panic on a misaligned read-back.
    RUST_BACKTRACE=1 run comm-check "comm-check, world size 1, CUDA tensors" \
        "$bin_dir/wildfire" comm-check --device cuda
    if [ "$gpus" -gt 1 ]; then
        run comm-check-nccl "comm-check, $gpus processes (one per GPU), CUDA tensors, tcp transport" \
            "$bin_dir/wildfire" launch --nproc-per-node "$gpus" --master-port 29555 -- \
            "$bin_dir/wildfire" comm-check --device cuda
    else
        note "SKIP  multi-GPU comm-check and NCCL between ranks: only 1 GPU present (the one-rank NCCL probe ran)"
    fi
    run test-gpu "decorator + collectives tests on CUDA tensors, bare and fused (ranks as threads)" \
        cargo_test wildfire-tests integration gpu:: --nocapture --test-threads 1
fi

echo
echo "gpu-check summary (logs in $logs; autotune and PTX caches in $cache):"
printf '  %s\n' "${summary[@]}"
if compgen -G "$logs/gpt2-run-*" >/dev/null; then
    echo
    python3 scripts/gpu-summary.py "$logs"
fi
exit $failed
