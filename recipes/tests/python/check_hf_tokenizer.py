"""Encodes a text file with Hugging Face transformers' fast tokenizer built from a tokenizer.json
(PreTrainedTokenizerFast, what AutoTokenizer gives for Llama 3) and prints, as one JSON object,
the ids without special tokens ("ids") and their decoding ("decoded"). Exits 2 when transformers
is missing (the caller reports the check as skipped).

usage: python3 check_hf_tokenizer.py TOKENIZER_JSON TEXT_FILE
"""
import json
import sys

try:
    from transformers import PreTrainedTokenizerFast
except ImportError as missing:
    print(f"{missing} (pip install transformers)", file=sys.stderr)
    sys.exit(2)

tokenizer = PreTrainedTokenizerFast(tokenizer_file=sys.argv[1])
with open(sys.argv[2], encoding="utf-8", newline="") as f:
    text = f.read()
ids = tokenizer.encode(text, add_special_tokens=False)
decoded = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
print(json.dumps({"ids": ids, "decoded": decoded}))
