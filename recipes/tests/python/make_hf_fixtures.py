"""Writes the Hugging Face model fixtures of recipes/tests/hf_models.rs: a tiny model of each
family wildfire reads (random weights from a fixed seed, saved with `save_pretrained`) and what
transformers computes with it, so CI, which has no transformers, can compare against it.

Each fixture is a directory under recipes/tests/fixtures/hf/ holding `config.json`,
`model.safetensors`, the family's tokenizer (`tokenizer.json`, `tokenizer_config.json`) and
`expected.json`: the prompt's ids, the logits at the prompt's last position, the greedy
continuation by 20 tokens, and the same from a text prompt (its ids as the tokenizer encodes it
without special tokens, and prompt and continuation decoded as the tokenizer decodes them).

The tokenizers have each family's design, built by transformers' own class of it: Llama 3's
byte-level BPE (its pre-tokenisation pattern, kept as `TokenizersBackend` as Llama 3 ships it),
Qwen's (`Qwen2Tokenizer`: NFC, its own pattern, byte-level BPE) and Mistral's SentencePiece-style
BPE (`LlamaTokenizer`: `▁` for spaces, byte fallback). Their vocabularies are trained by
`tokenizers` on CORPUS to the model's 96 ids, so their alphabet is the corpus's characters (no
256-byte alphabet), which keeps the fixtures small. Every greedy step's top logit leads the
runner-up by at least MARGIN, so a reimplementation within 1e-4 of these logits picks the same
ids. The weights are drawn wider than an initialisation (N(0, 0.3)), so the continuation is not
one token repeated, and every bias is drawn too (transformers initialises them to zero).

usage: python3 make_hf_fixtures.py   (with torch and transformers == TRANSFORMERS installed)
"""
import json
import os
import sys

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaTokenizer,
    MistralConfig,
    Qwen2Config,
    Qwen2Tokenizer,
    Qwen3Config,
    TokenizersBackend,
)

TRANSFORMERS = "5.25.0"
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "hf")
PROMPT = [5, 17, 42, 3, 88, 60, 21, 9]
NEW = 20
MARGIN = 1e-3
# Text prompts, tried in order: the first whose greedy continuation keeps MARGIN is used.
TEXT_PROMPTS = ["the model learns", "each rank holds a part", "a token at a time", "the loss falls"]
# What the tokenizers are trained on.
CORPUS = [
    "a model reads the text it was given and writes the next word of it, one token at a time.",
    "each rank holds a part of the model; the parts meet when the step is done.",
    "the loss falls as the model learns, and the learning rate decays to a tenth of its peak.",
    "when a rank stops, the others name it and stop too, so no run waits for ever.",
    "two heads share their keys and values; the window moves along with the text.",
] * 4
# Llama 3's pre-tokenisation pattern (its tokenizer.json's `Split`).
LLAMA3_PIECES = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The sizes every fixture shares: 2 blocks, 4 query heads sharing 2 key/value heads.
SIZES = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)

# Each fixture's seed, config and tokenizer design.
FIXTURES = {
    # Llama 3's scaled RoPE, as transformers 5 writes it (`rope_parameters`).
    "llama": (0, LlamaConfig(**SIZES, rope_parameters=dict(LLAMA3_ROPE)), "llama3"),
    # Heads set apart from the width: 4 heads of 16 on a width of 32 (Qwen3's, Mistral-Nemo's).
    "llama-head-dim": (
        1,
        LlamaConfig(**SIZES, head_dim=16, rope_parameters={"rope_theta": 10000.0}),
        "llama3",
    ),
    # Qwen2: biases on Q, K and V alone; a sliding window switched off, as Qwen2 ships it.
    "qwen2": (
        2,
        Qwen2Config(
            **SIZES,
            use_sliding_window=False,
            sliding_window=4096,
            max_window_layers=2,
            rope_parameters={"rope_theta": 1000000.0},
        ),
        "qwen",
    ),
    # Qwen3: an RMSNorm of each head of Q and K, heads set apart from the width.
    "qwen3": (
        4,
        Qwen3Config(**SIZES, head_dim=16, rope_parameters={"rope_theta": 1000000.0}),
        "qwen",
    ),
    # Mistral: a sliding window of 4 keys, well inside the prompt and its continuation.
    "mistral": (
        3,
        MistralConfig(**SIZES, sliding_window=4, rope_parameters={"rope_theta": 10000.0}),
        "sentencepiece",
    ),
}


def draw(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.3 * noise)


def greedy_ids(model, prompt):
    """The greedy continuation of the ids `prompt` by NEW tokens, or None when a step's top two
    logits are closer than MARGIN."""
    greedy, tokens = [], torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(NEW):
            logits = model(tokens).logits[0, -1]
            top = torch.topk(logits, 2).values
            if top[0] - top[1] < MARGIN:
                return None
            greedy.append(int(logits.argmax()))
            tokens = torch.cat([tokens, torch.tensor([[greedy[-1]]])], dim=1)
    return greedy


def trained_vocabulary(pipeline, vocab_size, specials):
    """The vocabulary and merges of a BPE trained on CORPUS to `vocab_size` ids (`specials`
    first) with the normaliser and pre-tokeniser of the tokenizer `pipeline`."""
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = pipeline.normalizer
    bpe.pre_tokenizer = pipeline.pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    bpe.train_from_iterator(CORPUS, trainer)
    model = json.loads(bpe.to_str())["model"]
    return model["vocab"], [tuple(pair) for pair in model["merges"]]


def tokenizer(design, vocab_size):
    """A tokenizer of `design` with `vocab_size` ids in all, built by transformers' class of it."""
    if design == "qwen":
        # Qwen2Tokenizer appends its one special token, <|endoftext|>, after the vocabulary.
        vocab, merges = trained_vocabulary(Qwen2Tokenizer().backend_tokenizer, vocab_size - 1, [])
        return Qwen2Tokenizer(vocab=vocab, merges=merges)
    if design == "sentencepiece":
        specials = ["<unk>", "<s>", "</s>"]
        pipeline = LlamaTokenizer().backend_tokenizer
        vocab, merges = trained_vocabulary(pipeline, vocab_size, specials)
        return LlamaTokenizer(vocab=vocab, merges=merges)
    assert design == "llama3", design
    bpe = Tokenizer(models.BPE(ignore_merges=True))
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PIECES), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), show_progress=False)
    bpe.train_from_iterator(CORPUS, trainer)
    return TokenizersBackend(tokenizer_object=bpe, bos_token=specials[0], eos_token=specials[1])


def expected(model, tok):
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        last = model(ids).logits[0, -1]
    greedy = greedy_ids(model, PROMPT)
    if greedy is None:
        sys.exit("the id prompt's greedy continuation has a near tie: choose another seed")
    for prompt in TEXT_PROMPTS:
        text_ids = tok(prompt, add_special_tokens=False).input_ids
        text_greedy = greedy_ids(model, text_ids)
        if text_greedy is not None:
            break
    else:
        sys.exit("every text prompt's greedy continuation has a near tie: add another")
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt": PROMPT,
        "last_logits": last.tolist(),
        "greedy": greedy,
        "text": {
            "prompt": prompt,
            "ids": text_ids,
            "greedy": text_greedy,
            "decoded": tok.decode(text_ids + text_greedy),
        },
    }


def older_form(config_path):
    """Rewrites a saved config.json in the form older checkpoints have: `rope_theta` beside a
    `rope_scaling` object, `torch_dtype` for `dtype`."""
    with open(config_path) as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    config["torch_dtype"] = config.pop("dtype")
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def main():
    if transformers.__version__ != TRANSFORMERS:
        sys.exit(f"transformers {transformers.__version__}: the fixtures are made with {TRANSFORMERS}")
    for name, (seed, config, design) in sorted(FIXTURES.items()):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        draw(model, seed)
        tok = tokenizer(design, config.vocab_size)
        assert len(tok) == config.vocab_size, (name, len(tok))
        dirs = [name] + (["llama-older-config"] if name == "llama" else [])
        for fixture in dirs:
            out = os.path.join(OUT, fixture)
            model.save_pretrained(out)
            tok.save_pretrained(out)
            if fixture == "llama-older-config":
                older_form(os.path.join(out, "config.json"))
                # The older form must describe the same model: reload it and compare.
                again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
                ids = torch.tensor([PROMPT])
                with torch.no_grad():
                    assert torch.equal(again(ids).logits, model(ids).logits), fixture
            os.remove(os.path.join(out, "generation_config.json"))
            with open(os.path.join(out, "expected.json"), "w") as f:
                json.dump(expected(model, tok), f, indent=1)
            print(f"wrote {out}")


if __name__ == "__main__":
    main()
