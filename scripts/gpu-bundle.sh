#!/usr/bin/env bash
# Builds everything `scripts/gpu-check.sh` runs, with `--features cuda`, on a machine that has
# Rust (no GPU needed), and copies the executables, without debug info, into one folder (default
# target/gpu-bundle), and that folder into one file beside it (`<folder>.tar.xz`). Copy either
# to a GPU machine that has CUDA but no Rust toolchain, with this repository, and run
# `WILDFIRE_GPU_BUNDLE=<folder> scripts/gpu-check.sh` there. Both machines need x86-64
# Linux, and the GPU machine a glibc at least as new as the build machine's.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${1:-target/gpu-bundle}
command -v jq >/dev/null || { echo "gpu-bundle: needs jq (apt-get install jq)" >&2; exit 1; }

# The executables gpu-check.sh runs: the two binaries and three crates' test binaries.
wanted="wildfire wildfire-benches backend recipes integration"
messages=$(mktemp)
cargo build --release --locked --features cuda \
    -p wildfire-backend -p wildfire-recipes -p wildfire-tests -p wildfire-benches \
    --tests --bins --message-format=json-render-diagnostics >"$messages"

rm -rf "$bundle" && mkdir -p "$bundle"
for name in $wanted; do
    # Cargo prints one artifact message per built target; take the executable of this name:
    # a binary itself (not its unit tests, which `--tests` builds under the same name) or an
    # integration test.
    executable=$(jq -r --arg name "$name" \
        'select(.reason == "compiler-artifact" and .target.name == $name and .executable != null
                and (.target.kind == ["test"] or .profile.test == false))
         | .executable' "$messages" | tail -1)
    if [ -z "$executable" ]; then
        echo "gpu-bundle: cargo built no executable named $name" >&2
        exit 1
    fi
    # Debug info out, symbols kept: a panic's backtrace still names its functions.
    strip --strip-debug -o "$bundle/$name" "$executable"
done
rm -f "$messages"
# One compressed file too (about a quarter of the folder's size), for copying.
tar -C "$(dirname "$bundle")" -cf - "$(basename "$bundle")" | xz -6 -T0 >"$bundle.tar.xz"
du -h "$bundle" "$bundle.tar.xz"
