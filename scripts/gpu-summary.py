#!/usr/bin/env python3
"""The GPU check's speed table: wildfire's training runs (their metrics.jsonl) beside PyTorch's
(the JSON line benches/reference/train_tiny.py prints), on the same GPU in the same check.

    scripts/gpu-summary.py LOGS

LOGS is the check's log folder: every `gpt2-run-*` folder in it is a wildfire run (but the
profiled one), every `torch-*.log` a PyTorch run. For wildfire it prints the first step apart (it compiles the kernels
and, with autotune, times the candidates of each new shape) from the steady state: the median
step of those after the first `WARMUP`, the tokens/s and MFU of that median, and the ratio to
PyTorch eager's and torch.compile's tokens/s where they ran.
"""

import json
import statistics
import sys
from pathlib import Path

# Steps left out of the steady state: the first compiles and tunes, the next few may still meet
# new shapes (evaluation, the optimizer's first step).
WARMUP = 5


def wildfire_runs(logs):
    for run in sorted(logs.glob("gpt2-run-*")):
        if run.name.endswith("-profile"):
            continue  # profiled: every kernel timed, so not a speed
        metrics = run / "metrics.jsonl"
        if not metrics.exists():
            yield run.name, None
            continue
        steps = []
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if "step_time_ms" in record:
                steps.append(record)
        yield run.name, steps


def pytorch_runs(logs):
    runs = {}
    for log in sorted(logs.glob("torch-*.log")):
        for line in log.read_text().splitlines():
            if line.startswith("{") and '"pytorch"' in line:
                record = json.loads(line)
                runs["torch.compile" if record.get("compile") else "PyTorch eager"] = record
    return runs


def main():
    logs = Path(sys.argv[1])
    torch = pytorch_runs(logs)
    rows = []
    for name, steps in wildfire_runs(logs):
        if not steps:
            rows.append((name, "no steps logged", "", "", "", "", ""))
            continue
        first = steps[0]["step_time_ms"]
        steady = [s for s in steps if s["step"] >= WARMUP] or steps
        median = statistics.median(s["step_time_ms"] for s in steady)
        middle = min(steady, key=lambda s: abs(s["step_time_ms"] - median))
        tokens = middle["tokens_per_sec"]
        mfu = middle.get("mfu")
        ratios = [
            f"{tokens / torch[which]['tokens_per_sec']:.3f}" if which in torch else "—"
            for which in ("PyTorch eager", "torch.compile")
        ]
        rows.append((
            name,
            f"{first:.0f}",
            f"{median:.1f}",
            f"{tokens:,.0f}",
            f"{100 * mfu:.2f}%" if mfu is not None else "—",
            *ratios,
        ))
    for which, record in torch.items():
        rows.append((which, "", f"{record['step_ms']:.1f}", f"{record['tokens_per_sec']:,.0f}",
                     "", "", ""))
    header = ("run", "first step ms", "steady step ms", "tokens/s", "MFU",
              "÷ eager", "÷ compile")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
