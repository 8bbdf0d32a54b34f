"""Writes the Hugging Face model fixtures of recipes/tests/hf_models.rs: a tiny model of each
family wildfire reads (random weights from a fixed seed, saved with `save_pretrained`) and what
transformers computes with it, so CI, which has no transformers, can compare against it.

Each fixture is a directory under recipes/tests/fixtures/hf/ holding `config.json`,
`model.safetensors` and `expected.json`: the prompt's ids, the logits at the prompt's last
position, and the greedy continuation by 20 tokens. Every greedy step's top logit leads the
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
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

TRANSFORMERS = "5.25.0"
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "hf")
PROMPT = [5, 17, 42, 3, 88, 60, 21, 9]
NEW = 20
MARGIN = 1e-3

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

# Each fixture's seed and config.
FIXTURES = {
    # Llama 3's scaled RoPE, as transformers 5 writes it (`rope_parameters`).
    "llama": (0, LlamaConfig(**SIZES, rope_parameters=dict(LLAMA3_ROPE))),
    # Heads set apart from the width: 4 heads of 16 on a width of 32 (Qwen3's, Mistral-Nemo's).
    "llama-head-dim": (
        1,
        LlamaConfig(**SIZES, head_dim=16, rope_parameters={"rope_theta": 10000.0}),
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
    ),
    # Qwen3: an RMSNorm of each head of Q and K, heads set apart from the width.
    "qwen3": (
        4,
        Qwen3Config(**SIZES, head_dim=16, rope_parameters={"rope_theta": 1000000.0}),
    ),
    # Mistral: a sliding window of 4 keys, well inside the prompt and its continuation.
    "mistral": (
        3,
        MistralConfig(**SIZES, sliding_window=4, rope_parameters={"rope_theta": 10000.0}),
    ),
}


def draw(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.3 * noise)


def expected(model):
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        last = model(ids).logits[0, -1]
        greedy, tokens = [], ids
        for _ in range(NEW):
            logits = model(tokens).logits[0, -1]
            top = torch.topk(logits, 2).values
            if top[0] - top[1] < MARGIN:
                sys.exit(f"a greedy step's top two logits are {top.tolist()}: choose another seed")
            greedy.append(int(logits.argmax()))
            tokens = torch.cat([tokens, torch.tensor([[greedy[-1]]])], dim=1)
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt": PROMPT,
        "last_logits": last.tolist(),
        "greedy": greedy,
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
    for name, (seed, config) in sorted(FIXTURES.items()):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        draw(model, seed)
        dirs = [name] + (["llama-older-config"] if name == "llama" else [])
        for fixture in dirs:
            out = os.path.join(OUT, fixture)
            model.save_pretrained(out)
            if fixture == "llama-older-config":
                older_form(os.path.join(out, "config.json"))
                # The older form must describe the same model: reload it and compare.
                again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
                ids = torch.tensor([PROMPT])
                with torch.no_grad():
                    assert torch.equal(again(ids).logits, model(ids).logits), fixture
            os.remove(os.path.join(out, "generation_config.json"))
            with open(os.path.join(out, "expected.json"), "w") as f:
                json.dump(expected(model), f, indent=1)
            print(f"wrote {out}")


if __name__ == "__main__":
    main()
