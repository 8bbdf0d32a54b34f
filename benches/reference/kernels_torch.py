"""PyTorch's own numbers for the shapes `wildfire-benches kernels` measures on a GPU: its
fused attention (scaled_dot_product_attention, FlashAttention-2 on Hopper in bf16) forward and
forward+backward, and its bf16 matmul, on the same device, FLOPs counted as the Rust bench counts
them (attention forward 4*b*h*s^2*d, halved under the causal mask; forward+backward 3.5x that;
matmul 2*n^3), and, with --gemm-shapes, its bf16 matmul at the GEMM shapes of a GPT-2 124M and a
Llama 3 8B training step (GEMM_SHAPES, the shapes of `wildfire-benches kernels --gemm-shapes`,
2*m*n*k). Gives docs/benchmarks/kernels.md a reference measured beside wildfire's numbers.

Usage: python3 benches/reference/kernels_torch.py [--batch 4 --heads 16 --seq 4096
       --head-dim 128 --matmul-size 8192 --rounds 10 --gemm-shapes]
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

# [tokens, k] x [k, n] for 8192 tokens; the same list as GEMM_SHAPES in benches/src/kernels.rs.
GEMM_SHAPES = [
    ("gpt2 qkv", (8192, 768, 2304)),
    ("gpt2 attn out", (8192, 768, 768)),
    ("gpt2 mlp up", (8192, 768, 3072)),
    ("gpt2 mlp down", (8192, 3072, 768)),
    ("gpt2 head", (8192, 768, 50304)),
    ("llama8b qkv", (8192, 4096, 6144)),
    ("llama8b attn out", (8192, 4096, 4096)),
    ("llama8b gate+up", (8192, 4096, 28672)),
    ("llama8b mlp down", (8192, 14336, 4096)),
    ("llama8b head", (8192, 4096, 128256)),
]


def median_ms(op, rounds):
    """Median milliseconds of `op` over `rounds` timed calls, after two warm-ups, timed with
    CUDA events."""
    for _ in range(2):
        op()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        op()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    for name, default in [("batch", 4), ("heads", 16), ("seq", 4096), ("head-dim", 128),
                          ("matmul-size", 8192), ("rounds", 10)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--gemm-shapes", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print(f"{'op':<28} {'shape':<30} {'ms':>9} {'TFLOP/s':>9}")

    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=torch.bfloat16)
    for causal in (False, True):
        forward_flops = 4 * args.batch * args.heads * args.head_dim * args.seq**2
        forward_flops /= 2 if causal else 1

        def forward():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def forward_backward():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.autograd.grad(out, (q, k, v), grad)

        for name, op, flops in [("sdpa fwd", forward, forward_flops),
                                ("sdpa fwd+bwd", forward_backward, 3.5 * forward_flops)]:
            ms = median_ms(op, args.rounds)
            label = f"{list(shape)} causal {str(causal).lower()}"
            print(f"{name:<28} {label:<30} {ms:>9.3f} {flops / ms / 1e9:>9.1f}")

    n = args.matmul_size
    a, b = (torch.randn((n, n), device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = median_ms(lambda: a @ b, args.rounds)
    print(f"{'matmul bf16':<28} {str([n, n, n]):<30} {ms:>9.3f} {2 * n**3 / ms / 1e9:>9.1f}")
    if args.gemm_shapes:
        for name, (m, k, n) in GEMM_SHAPES:
            a = torch.randn((m, k), device=device, dtype=torch.bfloat16)
            b = torch.randn((k, n), device=device, dtype=torch.bfloat16)
            ms = median_ms(lambda: a @ b, args.rounds)
            label = f"{m}x{k}.{k}x{n}"
            print(f"{name + ' bf16':<28} {label:<30} {ms:>9.3f} {2 * m * n * k / ms / 1e9:>9.1f}")


if __name__ == "__main__":
    main()
