"""Memory per rank of FeedForward(8192, 8192) trained under the torchrun engine, at 1, 2 and 4 ranks.

The Lightning tensor-parallel guide's example: w1, w3 column-parallel, w2 row-parallel, AdamW. For each
rank count the script starts that many gloo processes on this machine (the CPU stands in for GPUs), builds
the model on the meta device, parallelizes it, materialises only the local shards, runs one training step
on a (8, 8192) batch and counts, per rank, the bytes of its parameters, gradients and optimizer state
(local shards of the DTensors), plus the process's peak resident memory (which also holds PyTorch itself
and the activations). Parameters + gradients + optimizer state must fall as 1/N.

    python benchmarks/torchrun_memory.py [--ranks 1 2 4] [--dim 8192] [--out benchmarks/results/torchrun_memory.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tensorshard as tp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suite.config import FeedForward  # noqa: E402  (the Lightning guide's MLP)


PLAN = {"w1": tp.ColwiseParallel(), "w2": tp.RowwiseParallel(), "w3": tp.ColwiseParallel()}


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _rank(rank: int, world: int, init_file: str, dim: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    from torch.distributed.device_mesh import init_device_mesh

    with torch.device("meta"):
        model = FeedForward(dim, dim)  # no full copy anywhere: each rank materialises its shards only
    model = tp.parallelize(model, init_device_mesh("cpu", (world,)), plan=PLAN, src_data_rank=None)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, dim**-0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, dim, generator=torch.Generator().manual_seed(0))
    model(x).square().mean().backward()
    opt.step()
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters())
    state = sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    results.put((rank, params, grads, state, peak))
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, dim: int) -> list[tuple]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        procs = [
            ctx.Process(target=_rank, args=(r, world, os.path.join(folder, "rendezvous"), dim, results)) for r in range(world)
        ]
        for p in procs:
            p.start()
        rows = sorted(results.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dim", type=int, default=8192)
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()

    gib = 2**30
    lines = [
        f"# Memory per rank, FeedForward({args.dim}, {args.dim}), AdamW, torchrun engine",
        "",
        f"{datetime.date.today()}, {platform.machine()} CPU ({os.cpu_count()} cores), gloo, torch {torch.__version__}; "
        "one training step on a (8, dim) batch. Columns are per rank (rank 0; all ranks are equal here).",
        "",
        "| ranks | parameters GiB | gradients GiB | optimizer state GiB | total GiB | total x ranks / 1-rank total | peak RSS GiB |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    first_total = None
    for world in args.ranks:
        rows = measure(world, args.dim)
        _, params, grads, state, peak = rows[0]
        assert all(r[1:4] == rows[0][1:4] for r in rows), rows  # every rank holds the same share
        total = params + grads + state
        if first_total is None:
            first_total = total * args.ranks[0]  # the whole model's bytes, over all ranks
        lines.append(
            f"| {world} | {params / gib:.3f} | {grads / gib:.3f} | {state / gib:.3f} | {total / gib:.3f} | "
            f"{total * world / first_total:.3f} | {peak / gib:.2f} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        tmp = f"{args.out}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
