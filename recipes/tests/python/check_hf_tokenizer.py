"""Encodes a text file with a Hugging Face transformers tokenizer and prints, as one JSON object,
the ids without special tokens ("ids") and a decoding ("decoded"): of the ids given on the
command line, else of those ids. TOKENIZER is a tokenizer.json, run by transformers' fast
tokenizer built from it (PreTrainedTokenizerFast, what AutoTokenizer gives for Llama 3) and
decoded without cleaning up spaces, or a model directory, loaded and decoded as a user would
(AutoTokenizer.from_pretrained, `decode` with its defaults). Exits 77 when transformers is
missing (the caller decides whether that skips the check or fails it).

usage: python3 check_hf_tokenizer.py TOKENIZER TEXT_FILE [ID ...]
"""
import json
import os
import sys

# The exit status for a missing module: 77, the "skipped" status of automake's test harness.
# Python itself exits 2 for a missing script or bad arguments, which must fail the caller.
MODULE_MISSING = 77

try:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
except ImportError as missing:
    print(f"{missing} (pip install transformers)", file=sys.stderr)
    sys.exit(MODULE_MISSING)

path, text_file, given = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3:]]
if os.path.isdir(path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    decode = tokenizer.decode
else:
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=path)
    decode = lambda ids: tokenizer.decode(ids, clean_up_tokenization_spaces=False)
with open(text_file, encoding="utf-8", newline="") as f:
    text = f.read()
ids = tokenizer.encode(text, add_special_tokens=False)
print(json.dumps({"ids": ids, "decoded": decode(given or ids)}))
