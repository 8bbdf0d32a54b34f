#!/usr/bin/env bash
# Prepared data at scale, measured side by side in one run (docs/benchmarks/data.md):
#   1. `wildfire prepare` of a generated corpus (GPT-2 tokens) against tiktoken's Python
#      `encode_ordinary_batch` on the same files with the same threads;
#   2. `wildfire train --data` on it (tiny GPT, 5 steps) against the same run on the bundled
#      corpus: peak resident memory (anonymous and file-backed, sampled from /proc) and the time
#      from start to the first step's log line.
# Usage: benches/data.sh [MB of text, default 1024] [threads, default 2]
# Needs: `pip install tiktoken`; builds the release `wildfire` binary.
set -euo pipefail
cd "$(dirname "$0")/.."
mb=${1:-1024}
threads=${2:-2}
work=${WILDFIRE_BENCH_DIR:-/tmp/wildfire-bench-data}
rm -rf "$work" && mkdir -p "$work/corpus"
cargo build --release -q -p wildfire-recipes
wildfire=target/release/wildfire
ranks=$(ls ~/.cargo/registry/src/*/tiktoken-rs-0.7.*/assets/r50k_base.tiktoken | head -1)

echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, \
avx512f: $(grep -qw avx512f /proc/cpuinfo && echo yes || echo no); $(date -u +%F)"

# Documents of 200 to 2000 of the bundled Shakespeare's lines, shuffled (seeded), as JSON lines
# in files of about 64 MB, up to $mb MB of text.
python3 - "$work/corpus" "$mb" <<'PY'
import json, random, sys
out, total = sys.argv[1], int(sys.argv[2]) * 10**6
lines = open("recipes/data/shakespeare.txt", encoding="utf-8").read().splitlines(keepends=True)
rng, written, index = random.Random(7), 0, 0
while written < total:
    size = 0
    with open(f"{out}/part-{index:03}.jsonl", "w", encoding="utf-8") as f:
        while size < 64 * 10**6 and written + size < total:
            start = rng.randrange(len(lines))
            text = "".join(lines[start : start + rng.randrange(200, 2000)])
            f.write(json.dumps({"text": text}) + "\n")
            size += len(text.encode("utf-8"))
    written += size
    index += 1
PY
echo "corpus: $(ls "$work/corpus" | wc -l) JSON-lines files"

tiktoken=$(python3 benches/reference/data_tiktoken.py --ranks "$ranks" --threads "$threads" "$work"/corpus/*.jsonl)
echo "tiktoken encode_ordinary_batch: $tiktoken"
start=$(date +%s.%N)
"$wildfire" prepare --input "$work/corpus" --out "$work/prepared" --tokenizer gpt2 \
    --val-fraction 0.01 --threads "$threads" > "$work/prepare.log"
end=$(date +%s.%N)
cat "$work/prepare.log"
python3 - "$tiktoken" "$start" "$end" <<'PY'
import json, sys
tk = json.loads(sys.argv[1])
seconds = float(sys.argv[3]) - float(sys.argv[2])
ours, theirs = tk["bytes"] / seconds / 1e6, tk["bytes"] / tk["seconds"] / 1e6
print(f"wildfire prepare: {seconds:.1f} s, {ours:.1f} MB/s; tiktoken {theirs:.1f} MB/s; ratio {ours / theirs:.2f}x")
PY

# Peak RSS (anonymous, file-backed) sampled every 20 ms; seconds from the start to the line
# the run prints as its first step begins (`training … steps 0..5`), and to step 0's line.
measure() {
    local name=$1; shift
    local log="$work/$name.log"
    local start; start=$(date +%s.%N)
    "$wildfire" train "$@" --set run.dir="$work/run-$name" --set train.max_steps=5 \
        --set train.eval_every=0 --set checkpoint.every=0 --set run.threads="$threads" \
        > "$log" 2>&1 &
    local pid=$! anon=0 file=0 ready="" first=""
    while kill -0 "$pid" 2>/dev/null; do
        if [ -r "/proc/$pid/status" ]; then
            read -r a f < <(awk '/RssAnon/{a=$2} /RssFile/{f=$2} END{print a+0, f+0}' "/proc/$pid/status")
            [ "$a" -gt "$anon" ] && anon=$a
            [ "$f" -gt "$file" ] && file=$f
        fi
        if [ -z "$ready" ] && grep -q "^training " "$log"; then
            ready=$(echo "$(date +%s.%N) - $start" | bc)
        fi
        if [ -z "$first" ] && grep -q "^step 0/" "$log"; then
            first=$(echo "$(date +%s.%N) - $start" | bc)
        fi
        sleep 0.02
    done
    wait "$pid"
    echo "$name: peak anonymous $((anon / 1024)) MB, file-backed $((file / 1024)) MB; training starts after ${ready:-?} s, step 0 done after ${first:-?} s"
}
measure prepared --data "$work/prepared" --set data.tokenizer=gpt2
measure bundled --set data.tokenizer=gpt2
# The default tiny config (characters), whose steps are the quickest to feed.
measure tiny

# What the tiny config consumes (its median step, steps 2 on) against what the sampler and the
# mapped shards deliver.
step_ms=$(python3 - "$work/run-tiny/metrics.jsonl" <<'PY'
import json, sys
times = sorted([r["step_time_ms"] for r in map(json.loads, open(sys.argv[1])) if "step_time_ms" in r][1:])
print(times[len(times) // 2])
PY
)
cargo build --release -q -p wildfire-benches
sampler=$(target/release/wildfire-benches data --prepared "$work/prepared")
echo "$sampler"
python3 - "$step_ms" "$sampler" <<'PY'
import sys
consumed = 1000 / float(sys.argv[1])
delivered = float(sys.argv[2].split(": ")[-1].split()[0])
print(f"training consumes {consumed:.1f} batches/s (median step {float(sys.argv[1]):.0f} ms); "
      f"the sampler delivers {delivered:.0f}: {delivered / consumed:.0f}x")
PY
