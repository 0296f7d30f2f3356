"""Which threads do the work of an in-process backward pass: CPU seconds per thread, and the wall time.

CPU time per thread hardly depends on what else runs on the machine, so this shows whether the shards'
backward passes can overlap even on a loaded machine: with every shard owning its graph, each shard's
thread does its share; with one graph spanning the shards, the caller's thread does all of it. The wall
time only approaches 1/N of the 1-device time with N idle cores. Linux only (reads /proc).

    python benchmarks/backward_threads.py [--devices 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import copy
import os
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

import tensorshard as tp


class Block(nn.Module):
    """A pre-norm MLP block (dim -> 4 dim -> dim) with a residual: one all-reduce each way once split."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def thread_cpu_seconds(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one intra-op thread per simulated device
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.dim) for _ in range(args.layers)))
    plan = {"*.up": tp.ColwiseParallel(), "*.down": tp.RowwiseParallel()}
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * args.devices, plan=plan, sharded=False)
    x = torch.randn(8, 256, args.dim, generator=torch.Generator().manual_seed(0))
    print(f"load average {os.getloadavg()}; {args.devices} CPU slots, {args.layers} blocks of width {args.dim}")
    for step in range(args.steps + 1):  # the first step starts the worker threads
        loss = split(x).square().mean()
        threads = {"caller": threading.get_native_id(), **{t.name: t.native_id for t in split._pool._threads.values()}}
        before = {name: thread_cpu_seconds(tid) for name, tid in threads.items()}
        start = time.perf_counter()
        loss.backward()
        wall = time.perf_counter() - start
        cpu = {name: round(thread_cpu_seconds(tid) - before[name], 2) for name, tid in threads.items()}
        split.zero_grad()
        if step:
            print(f"backward: wall {wall:.2f} s, CPU seconds by thread {cpu}")


if __name__ == "__main__":
    main()
