"""Reads a wildfire run directory with TensorBoard's own reader (EventAccumulator) and checks it
against metrics.jsonl: every training step's loss, lr and grad norm, the validation losses, and
the config text. Exits 0 when everything matches, 1 with the differences otherwise, and 77 when
the tensorboard package is missing (the caller decides whether that skips the check or
fails it).

usage: python3 check_tensorboard.py RUN_DIR
"""
import json
import struct
import sys

# The exit status for a missing module: 77, the "skipped" status of automake's test harness.
# Python itself exits 2 for a missing script or bad arguments, which must fail the caller.
MODULE_MISSING = 77

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError:
    print("tensorboard is not installed (pip install tensorboard)", file=sys.stderr)
    sys.exit(MODULE_MISSING)


def as_f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


run_dir = sys.argv[1]
records = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
train = {r["step"]: r for r in records if r["kind"] == "train"}
evals = {r["step"]: r["val_loss"] for r in records if r["kind"] == "eval"}

accumulator = EventAccumulator(run_dir, size_guidance={"scalars": 0, "tensors": 0})
accumulator.Reload()
errors = []
for tag, field in [("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm")]:
    scalars = {e.step: e.value for e in accumulator.Scalars(tag)}
    expected = {step: as_f32(r[field]) for step, r in train.items()}
    if scalars != expected:
        errors.append(f"{tag}: TensorBoard has {len(scalars)} points, metrics.jsonl {len(expected)}")
val = {e.step: e.value for e in accumulator.Scalars("val/loss")}
if val != {step: as_f32(v) for step, v in evals.items()} or not val:
    errors.append(f"val/loss: TensorBoard {val}, metrics.jsonl {evals}")
text = accumulator.PluginTagToContent("text")
if "config" not in text:
    errors.append("no 'config' text")
else:
    config = accumulator.Tensors("config")[0].tensor_proto.string_val[0].decode()
    if "max_steps" not in config or "resolved_model" not in config:
        errors.append(f"config text lacks the resolved config: {config[:200]!r}")
for error in errors:
    print("tensorboard check failed:", error, file=sys.stderr)
sys.exit(1 if errors else 0)
