"""PyTorch reference for `wildfire-benches train` and `scripts/gpu-check.sh`: the recipe's GPT-2
(tied head, GELU-tanh, no dropout, decomposed attention as the recipe's reference path), AdamW
with decay on matrices, global-norm clipping at 1.0. `--model tiny` (the default): 4 layers, 4
heads, d_model 128, context 128, vocab 65, batch 16, on CPU. `--model gpt2`: GPT-2 124M (12
layers, 12 heads, 768 wide, context 1024, vocab 50304), batch `--batch`, usually with
`--device cuda --bf16` (autocast) and `--compile` (torch.compile). `--model llama-tiny`: the
recipe's Llama of the tiny size (RMSNorm, rotary embeddings on rotate-half pairs, SwiGLU 384
wide, 4 heads sharing 2 key/value heads, no biases, untied head), vocab 65, batch 16. Prints one
JSON line.

Usage: python3 train_tiny.py --threads N [--warmup W --steps S --model M --device D --batch B
                             --bf16 --compile]
"""

import argparse
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        # Decomposed attention, as the Rust recipe computes it (no fused kernel on either side).
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        y = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class LlamaBlock(nn.Module):
    def __init__(self, d, heads, kv_heads, hidden, context, theta=10000.0):
        super().__init__()
        self.heads, self.kv_heads, self.d_head = heads, kv_heads, d // heads
        self.ln_1 = nn.RMSNorm(d, eps=1e-5)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.d_head, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.d_head, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.ln_2 = nn.RMSNorm(d, eps=1e-5)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        half = self.d_head // 2
        omega = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / self.d_head)
        angles = torch.arange(context, dtype=torch.float64)[:, None] * omega[None, :]
        angles = torch.cat([angles, angles], dim=1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def rotate(self, x):
        t, half = x.shape[2], self.d_head // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos[:t] + rotated * self.sin[:t]

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln_1(x)
        q = self.q_proj(h).view(b, t, self.heads, self.d_head).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.d_head).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, self.d_head).transpose(1, 2)
        q, k = self.rotate(q), self.rotate(k)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_head)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        y = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, d))
        h = self.ln_2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab, context, d, layers, heads, kv_heads, hidden):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            LlamaBlock(d, heads, kv_heads, hidden, context) for _ in range(layers)
        )
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Gpt(nn.Module):
    def __init__(self, vocab, context, d, layers, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", choices=["tiny", "gpt2", "llama-tiny"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--bf16", action="store_true", help="autocast the forward to bf16")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the timed steps, print torch.profiler's table of this many more")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    vocab, context, d, layers, heads = {
        "tiny": (65, 128, 128, 4, 4),
        "gpt2": (50304, 1024, 768, 12, 12),
        "llama-tiny": (65, 128, 128, 4, 4),
    }[args.model]
    batch = args.batch
    if args.model == "llama-tiny":
        model = Llama(vocab, context, d, layers, heads, kv_heads=2, hidden=384).to(device)
    else:
        model = Gpt(vocab, context, d, layers, heads).to(device)
    step_model = torch.compile(model) if args.compile else model
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.99), eps=1e-8, foreach=True,
    )
    data = torch.randint(0, vocab, (batch, context + 1), device=device)
    inputs, targets = data[:, :-1], data[:, 1:]
    def one_step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = step_model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        one_step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if args.profile > 0:
        # The same step under torch.profiler, beside `wildfire train --profile`'s tables.
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(args.profile):
                one_step()
        sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"torch.profiler, {args.profile} steps:", file=sys.stderr)
        print(profile.key_averages().table(sort_by=sort_by, row_limit=30), file=sys.stderr)
    times.sort()
    median = times[len(times) // 2]
    print(json.dumps({
        "system": "pytorch", "version": torch.__version__, "threads": args.threads,
        "model": args.model, "device": args.device, "batch": batch, "bf16": args.bf16,
        "compile": args.compile,
        "step_ms": 1e3 * median, "tokens_per_sec": batch * context / median,
    }))


if __name__ == "__main__":
    main()
