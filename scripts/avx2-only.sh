#!/usr/bin/env bash
# Runs a cargo command on the AVX2 path, on any x86-64 CPU: what an AVX2-only machine computes,
# reproduced on one with AVX-512. With no arguments it runs the README's test command.
#
#   scripts/avx2-only.sh                          # cargo test --release --workspace, AVX2 path
#   scripts/avx2-only.sh test --release -p wildfire-recipes --test recipes -- data_parallel::
#
# Three dependencies pick their SIMD at run time and take AVX-512 where the CPU has it:
# - gemm (Flex's matmuls and ours) and pulp (wildfire's native loops): their AVX-512 code is
#   wildfire-backend's `avx512` feature, which `--no-default-features` leaves out;
# - macerator (Flex's elementwise ops and reductions) turns its AVX-512 code on by default, and
#   burn-flex asks for its defaults, so no feature of ours can turn it off: this script builds
#   against a copy of the registry's macerator whose default features lack `avx512` (cargo's
#   `patch` from the command line). Cargo.lock is restored afterwards.
# The build shares target/ with the normal one (other feature hashes, so both stay built).
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(awk '$0 == "name = \"macerator\"" { getline; gsub(/"/, "", $3); print $3 }' Cargo.lock)
[ -n "$version" ] || { echo "avx2-only: no macerator in Cargo.lock" >&2; exit 1; }
cargo fetch --locked --quiet
crate=$(find "${CARGO_HOME:-$HOME/.cargo}/registry/cache" -name "macerator-$version.crate" | head -1)
[ -n "$crate" ] || { echo "avx2-only: macerator $version is not in cargo's cache" >&2; exit 1; }

patched=$PWD/target/avx2-only/macerator-$version
rm -rf "$patched" && mkdir -p "$patched"
tar -xzf "$crate" -C "$patched" --strip-components=1
sed -i '/^default = \[/,/^\]/{/"avx512",/d}' "$patched/Cargo.toml"
if grep -A3 '^default = \[' "$patched/Cargo.toml" | grep -q avx512; then
    echo "avx2-only: could not drop avx512 from macerator's default features" >&2
    exit 1
fi

lock_copy=$(mktemp)
cp Cargo.lock "$lock_copy"
trap 'cp "$lock_copy" Cargo.lock; rm -f "$lock_copy"' EXIT

if [ $# -eq 0 ]; then
    set -- test --release --workspace
fi
command=$1
shift
# The test sees which path it is on (`kernels::cpu_simd`'s test checks it).
export WILDFIRE_EXPECT_CPU_SIMD=avx2
cargo "$command" --no-default-features \
    --config "patch.crates-io.macerator.path = \"$patched\"" "$@"
