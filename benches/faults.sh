#!/usr/bin/env bash
# Injected faults and what a data-parallel job does about them (docs/benchmarks/faults.md): a
# 2-process job of the tiny GPT (60 steps, a checkpoint every 10) under
# `wildfire launch --max-restarts 1 -- wildfire train --resume auto`, one fault per run:
#   kill       rank 1 SIGKILLed from outside after the step-10 checkpoint
#   shard      rank 1 dies inside the step-20 checkpoint before its shard (rank 0's is written),
#              synchronous and background (checkpoint.async) writes
#   commit     rank 0 dies inside the step-20 checkpoint before the commit (every shard written)
#   hang       rank 1 SIGSTOPped after the step-10 checkpoint (a hung peer; 10 s deadline)
#   launcher   the launcher SIGKILLed after the step-10 checkpoint; the same command run again
#   node       a 2-node job (a launcher per node, on this host) whose node-1 rank is SIGKILLed
# For each: when it was detected (a rank's error or the launcher's restart line; node 0's
# launcher's exit for the 2-node job), when the job
# trained again (the restarted run's first step), the steps redone, and whether every step is in
# metrics.jsonl exactly once and the final loss equals the run without a fault.
# Usage: benches/faults.sh        Builds the release `wildfire` binary.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p wildfire-recipes
wildfire=$PWD/target/release/wildfire
work=${WILDFIRE_BENCH_DIR:-/tmp/wildfire-bench-faults}
rm -rf "$work" && mkdir -p "$work"
port=29811

echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, \
avx512f: $(grep -qw avx512f /proc/cpuinfo && echo yes || echo no); $(date -u +%F)"

now() { date +%s.%N; }
# Prefixes every line with the time it arrived.
stamp() { while IFS= read -r line; do printf '%s %s\n' "$(now)" "$line"; done; }
# The pid of the child of $1 whose environment has RANK=$2.
rank_pid() {
  for child in $(pgrep -P "$1"); do
    if tr '\0' '\n' <"/proc/$child/environ" 2>/dev/null | grep -qx "RANK=$2"; then
      echo "$child"
    fi
  done
}
# "gone" once process $1 has exited (a zombie left to be reaped counts as gone), else its state.
state() {
  local s
  s=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true)
  if [ -z "$s" ] || [ "$s" = Z ]; then echo gone; else echo "$s"; fi
}
# Waits until the file $1 exists.
wait_for() { until [ -e "$1" ]; do sleep 0.01; done; }
# The time stamp of the first line of log $1 matching $2 (after line $3, default 0).
first() { tail -n +"$((${3:-0} + 1))" "$1" | grep -m1 -- "$2" | cut -d' ' -f1; }
# When the job noticed the fault: a rank's error, or the launcher's restart line.
detected() { first "$1" "\] error: \|restarting all ranks"; }
secs() { python3 -c "print(f'{$2 - $1:.2f} s')"; }

train_args() { # $1: run directory; then extra --set values
  local dir=$1
  shift
  echo train --dp 2 --resume auto --set "run.dir=$dir" --set model.context=32 \
    --set train.micro_batch=4 --set train.max_steps=60 --set train.eval_every=0 \
    --set train.warmup_steps=5 --set checkpoint.every=10 --set checkpoint.keep_last=0 \
    --set run.log_every=1 "${@/#/--set }"
}

# Starts a 2-rank job in the background; sets $launcher and the log $work/$name.log.
start() { # $1: name; then extra --set values
  local name=$1
  shift
  port=$((port + 2))
  # shellcheck disable=SC2046
  "$wildfire" launch --nproc-per-node 2 --max-restarts 1 --master-port "$port" -- \
    "$wildfire" $(train_args "$work/$name" "$@") > >(stamp >"$work/$name.log") 2>&1 &
  launcher=$!
}

# Every step of run $1 once in metrics.jsonl, and its final loss.
check_metrics() {
  python3 - "$1/metrics.jsonl" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"train"' in l]
numbers = [s["step"] for s in steps]
print(steps[-1]["loss"], "each step once" if numbers == list(range(60)) else f"STEPS WRONG: {numbers}")
PY
}

report() { # $1: name, $2: fault time, $3: detection time, $4: extra note
  local log=$work/$1.log
  local restart_line
  restart_line=$(grep -n -m1 "restarting all ranks" "$log" | cut -d: -f1 || true)
  local back=""
  [ -n "$restart_line" ] && back=$(first "$log" "] step " "$restart_line")
  local steps redone
  steps=$(grep -c "\[rank 0\] step " "$log" || true)
  redone=$((steps - 60))
  read -r loss metrics < <(check_metrics "$work/$1")
  local same="final loss $loss"
  [ "$loss" = "$reference_loss" ] && same="final loss as without a fault"
  printf '| %s | %s | %s | %s | %s; %s%s |\n' "$1" "$(secs "$2" "$3")" \
    "$([ -n "$back" ] && secs "$2" "$back" || echo —)" "$redone" "$metrics" "$same" "${4:-}"
}

# The run without a fault.
start reference
wait "$launcher"
read -r reference_loss _ < <(check_metrics "$work/reference")

echo "| fault | detected after | training again after | steps redone | data |"
echo "|---|---|---|---|---|"

# Sends signal $2 to rank 1 of job $1 once its step-10 checkpoint is committed; reports.
signal_rank_1() {
  wait_for "$work/$1/checkpoints/step-00000010/COMMIT"
  local victim t0
  victim=$(rank_pid "$launcher" 1)
  t0=$(now)
  kill "-$2" "$victim"
  wait "$launcher"
  report "$1" "$t0" "$(detected "$work/$1.log")"
}

start kill
signal_rank_1 kill KILL

for background in false true; do
  for point in shard:1 commit:0; do
    name="${point%:*}-async-$background"
    rank=${point#*:}
    WILDFIRE_CRASH_AT="before-${point%:*}:20:$rank" start "$name" "checkpoint.async=$background"
    wait "$launcher"
    removed=$(grep -o "removed 1 unfinished checkpoint writes" "$work/$name.log" | head -1 || true)
    report "$name" "$(first "$work/$name.log" "dies before-")" \
      "$(detected "$work/$name.log")" "; ${removed:-NOTHING REMOVED}"
  done
done

WILDFIRE_COMM_TIMEOUT=10 start hang
signal_rank_1 hang STOP

# The launcher killed: its ranks die with it (PR_SET_PDEATHSIG); the same command continues.
start launcher
wait_for "$work/launcher/checkpoints/step-00000010/COMMIT"
ranks="$(rank_pid "$launcher" 0) $(rank_pid "$launcher" 1)"
t0=$(now)
kill -KILL "$launcher"
for pid in $ranks; do while [ "$(state "$pid")" != gone ]; do sleep 0.01; done; done
t1=$(now)
mv "$work/launcher.log" "$work/launcher-first.log"
start launcher
wait "$launcher"
back=$(first "$work/launcher.log" "] step ")
steps=$(($(cat "$work/launcher-first.log" "$work/launcher.log" | grep -c "\[rank 0\] step ") - 60))
read -r loss metrics < <(check_metrics "$work/launcher")
printf '| launcher (ranks gone; rerun) | %s | %s after the rerun | %s | %s; final loss %s |\n' \
  "$(secs "$t0" "$t1")" "$(secs "$(first "$work/launcher.log" "")" "$back")" "$steps" "$metrics" \
  "$([ "$loss" = "$reference_loss" ] && echo "as without a fault" || echo "$loss")"

# Two nodes, one rank each; node 1's rank killed: node 0's launcher must fail fast, naming why.
port=$((port + 2))
for node in 0 1; do
  # shellcheck disable=SC2046
  WILDFIRE_JOB_TOKEN=faults-bench WILDFIRE_ADVERTISE_ADDR=127.0.0.1 "$wildfire" launch \
    --nnodes 2 --node-rank "$node" --nproc-per-node 1 --master-port "$port" -- \
    "$wildfire" $(train_args "$work/node" "train.max_steps=100000") \
    > >(stamp >"$work/node$node.log") 2>&1 &
  eval "node$node=$!"
done
until grep -q "\] step 3" "$work/node0.log" 2>/dev/null; do sleep 0.01; done
victim=$(rank_pid "$node1" 1)
t0=$(now)
kill -KILL "$victim"
wait "$node0" || true
wait "$node1" || true
failure=$(grep -m1 "wildfire launch: rank 0" "$work/node0.log")
printf '| node (node 0 fails) | %s | — (the scheduler restarts the job) | — | %s |\n' \
  "$(secs "$t0" "$(echo "$failure" | cut -d' ' -f1)")" "$(echo "$failure" | cut -d' ' -f2- | cut -c1-240)"
