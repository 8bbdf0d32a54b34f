"""PyTorch gloo reference for `wildfire-benches comm`: the same ops, sizes and timing rule on
torch.distributed's gloo backend, ranks as processes of this host over loopback. Each iteration
builds a fresh f32 input (not timed), then times the collective; the iteration count comes from
the slowest rank's warm-up, and the reported time is the slowest rank's mean. Prints one JSON
line per measurement (op, transport "gloo", ranks, bytes, time_s).

Usage: python3 comm_gloo.py --ranks N --sizes B,B,... --ops all_reduce,... --seconds S
"""

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def one_op(op, x, rank, n):
    if op == "all_reduce":
        dist.all_reduce(x)
    elif op == "all_gather":
        out = torch.empty(n * x.numel())
        dist.all_gather_into_tensor(out, x)
    elif op == "reduce_scatter":
        # gloo has no reduce_scatter: not measured.
        raise NotImplementedError
    elif op == "broadcast":
        dist.broadcast(x, 0)
    elif op == "all_to_all":
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
    elif op == "send_recv":
        if rank == 0:
            dist.send(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
    elif op == "barrier":
        dist.barrier()


def input_elems(op, size, n):
    """Elements of each rank's input for a measurement of `size` bytes (nccl-tests' bytes)."""
    elems = size // 4
    return elems // n if op == "all_gather" else elems


def timed(op, elems, rank, n, iters):
    total = 0.0
    for _ in range(iters):
        x = torch.full((elems,), float(rank + 1))
        dist.barrier()
        t = time.perf_counter()
        one_op(op, x, rank, n)
        total += time.perf_counter() - t
    return total / iters


def slowest(value):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def worker(rank, n, port, args):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    for op in args.ops:
        if op == "reduce_scatter":
            continue
        for size in [0] if op == "barrier" else args.sizes:
            elems = input_elems(op, size, n)
            warm = slowest(timed(op, elems, rank, n, 3))
            iters = max(3, int(args.seconds / max(warm, 1e-9)))
            mean = slowest(timed(op, elems, rank, n, iters))
            if rank == 0:
                record = {"op": op, "transport": "gloo", "ranks": n, "bytes": size, "time_s": mean}
                print(json.dumps(record), flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--ops", required=True)
    parser.add_argument("--seconds", type=float, default=0.25)
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.ops = args.ops.split(",")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.ranks, port, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
