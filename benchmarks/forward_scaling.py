"""Forward time of FeedForward(4096, 16384) on a (64, 4096) input, unsplit and split over N CPU slots.

Each simulated device gets one intra-op thread (torch.set_num_threads(1)), so on a machine with two
cores two shards can at best halve the time. Usage: python benchmarks/forward_scaling.py [--devices 1 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

import tensorshard as tp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suite.config import FeedForward  # noqa: E402  (the Lightning guide's MLP)


def time_forward(model: nn.Module, x: torch.Tensor, repeats: int) -> list[float]:
    with torch.no_grad():
        model(x)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2], help="device counts to time")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=16384)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    torch.set_num_threads(1)
    x = torch.randn(args.tokens, args.dim)
    plan = tp.Plan({"w[13]": tp.ColwiseParallel(), "w2": tp.RowwiseParallel()})
    torch.manual_seed(0)
    plain = FeedForward(args.dim, args.hidden)
    base = statistics.median(time_forward(plain, x, args.repeats))
    print(f"FeedForward({args.dim}, {args.hidden}), input ({args.tokens}, {args.dim}), 1 thread per device")
    print(f"{'model':<18}{'median ms':>10}{'speed-up':>10}")
    print(f"{'unsplit':<18}{base * 1e3:>10.1f}{1.0:>10.2f}")
    for n in args.devices:
        torch.manual_seed(0)
        model = tp.tensor_parallel(FeedForward(args.dim, args.hidden), ["cpu"] * n, plan=plan)
        t = statistics.median(time_forward(model, x, args.repeats))
        print(f"{f'tensorshard N={n}':<18}{t * 1e3:>10.1f}{base / t:>10.2f}")
        del model


if __name__ == "__main__":
    main()
