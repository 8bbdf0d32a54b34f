"""tiktoken's GPT-2 encoder on the files given, for `benches/data.sh`.

Builds the r50k_base `Encoding` from the ranks file that the tiktoken-rs crate ships (tiktoken's
own loader would download it), reads the documents of the JSON-lines files given (field `text`)
and encodes them all with `encode_ordinary_batch` on `--threads` threads. Prints one JSON line:
the documents' UTF-8 bytes, tokens, seconds (building the encoding, reading and parsing
included, as `wildfire prepare`'s time includes them).
"""

import argparse
import json
import time

import tiktoken
from tiktoken.load import load_tiktoken_bpe

# GPT-2's pre-tokenisation pattern (tiktoken's r50k_base).
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", required=True, help="r50k_base.tiktoken")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()
    start = time.perf_counter()
    encoding = tiktoken.Encoding(
        name="r50k_base_local",
        pat_str=PATTERN,
        mergeable_ranks=load_tiktoken_bpe(args.ranks),
        special_tokens={"<|endoftext|>": 50256},
    )
    texts = []
    for path in args.files:
        with open(path, encoding="utf-8") as f:
            texts.extend(json.loads(line)["text"] for line in f if line.strip())
    batches = encoding.encode_ordinary_batch(texts, num_threads=args.threads)
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "bytes": sum(len(t.encode("utf-8")) for t in texts),
                "tokens": sum(len(b) for b in batches),
                "seconds": seconds,
            }
        )
    )


if __name__ == "__main__":
    main()
