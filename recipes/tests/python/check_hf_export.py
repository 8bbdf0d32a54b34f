"""Loads an exported directory with Hugging Face transformers as GPT2LMHeadModel and prints the
logits of the token ids given on the command line as JSON. Exits 2 when transformers or torch is
missing (the caller reports the check as skipped).

usage: python3 check_hf_export.py EXPORT_DIR ID [ID ...]
"""
import json
import sys

try:
    import torch
    from transformers import GPT2LMHeadModel
except ImportError as missing:
    print(f"{missing} (pip install torch transformers)", file=sys.stderr)
    sys.exit(2)

model = GPT2LMHeadModel.from_pretrained(sys.argv[1]).eval()
ids = torch.tensor([[int(t) for t in sys.argv[2:]]])
with torch.no_grad():
    logits = model(ids).logits[0]
print(json.dumps(logits.tolist()))
