"""Loads an exported directory with Hugging Face transformers (AutoModelForCausalLM: GPT-2 or
Llama, in f32) and prints, as one JSON object, the logits of the token ids given on the command
line ("logits", one row per position) and the greedy continuation of those ids by NEW tokens
("greedy", the new ids only). Exits 77 when transformers or torch is missing (the caller
decides whether that skips the check or fails it).

usage: python3 check_hf_export.py EXPORT_DIR NEW ID [ID ...]
"""
import json
import sys

# The exit status for a missing module: 77, the "skipped" status of automake's test harness.
# Python itself exits 2 for a missing script or bad arguments, which must fail the caller.
MODULE_MISSING = 77

try:
    import torch
    from transformers import AutoModelForCausalLM
except ImportError as missing:
    print(f"{missing} (pip install torch transformers)", file=sys.stderr)
    sys.exit(MODULE_MISSING)

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
new = int(sys.argv[2])
ids = torch.tensor([[int(t) for t in sys.argv[3:]]])
with torch.no_grad():
    logits = model(ids).logits[0]
    greedy = [] if new == 0 else model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )[0, ids.shape[1]:].tolist()
print(json.dumps({"logits": logits.tolist(), "greedy": greedy}))
