"""Each device's matrix-vector work in a decoding token, with and without `balance=True`: the CPU time of one token's
block projections per device, measured with the thread's own CPU clock, so a loaded machine changes little.

    python benchmarks/balanced_blocks.py [--model smollm] [--devices 2] [--rounds 15]

The model (benchmarks/suite/decoding_models.py) is built on the meta device and split by `shard_plan` as
`tp.tensor_parallel` would, even and balanced (plans/balance.py); for every device, random weights of that device's
local shapes of every split projection of the blocks (q, k, v, o, gate, up, down; norms, attention and the head left
out) are multiplied by one token's activation vector, one intra-op thread, one device after the other. Every block
ends in an all-reduce, so a token's block time is the sum over blocks of the slowest device's: the table prints
each device's median CPU ms per token and that maximum. It times the arithmetic the balanced split moves between the
devices, not a whole decode step (benchmarks/generation.py and generation_torchrun.py do, `--balance`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # suite/

from suite.decoding_models import DESCRIPTIONS, MODELS  # noqa: E402


def local_weights(model, sharded, rank: int) -> list:
    """Random weights of device `rank`'s local shapes of every split Linear weight inside the model's blocks."""
    import torch

    gen = torch.Generator().manual_seed(rank)
    out = []
    for name, ms in sharded.modules.items():
        if ".layers." not in name or "weight" not in ms.splits:
            continue
        dim, part = ms.splits["weight"]
        shape = list(model.get_submodule(name).weight.shape)
        shape[dim] = part.local_size(rank)
        out.append(torch.randn(shape, generator=gen))
    return out


def token_ms(weights: list, inputs: list) -> float:
    """CPU ms of one pass of `weights @ activation` (each weight times a vector of its input width)."""
    import torch

    started = time.thread_time()
    for w, x in zip(weights, inputs):
        torch.mv(w, x)
    return (time.thread_time() - started) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    import os

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tensorshard.plans import resolve_plan
    from tensorshard.plans.sharding import shard_plan

    torch.set_num_threads(1)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**MODELS[args.model]))
    plan = resolve_plan(model, None, args.devices)
    rows = {}
    for label, balance in (("even", False), ("balanced", True)):
        sharded = shard_plan(model, plan, args.devices, balance=balance)
        rows[label] = [local_weights(model, sharded, r) for r in range(args.devices)]
    inputs = {label: [[torch.randn(w.shape[1]) for w in ws] for ws in per_rank] for label, per_rank in rows.items()}
    times = {label: [[] for _ in range(args.devices)] for label in rows}
    for _ in range(args.rounds):  # interleaved: every split's every device once per round
        for label, per_rank in rows.items():
            for rank, weights in enumerate(per_rank):
                times[label][rank].append(token_ms(weights, inputs[label][rank]))
    results = {label: [statistics.median(t) for t in per_rank] for label, per_rank in times.items()}
    print(f"{DESCRIPTIONS[args.model]}, {args.devices} devices, one intra-op thread, medians of {args.rounds}; load "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| split | " + " | ".join(f"device {r} (CPU ms/token)" for r in range(args.devices)) + " | slowest |")
    print("|---|" + "---:|" * (args.devices + 1))
    for label, times in results.items():
        print(f"| {label} | " + " | ".join(f"{t:.2f}" for t in times) + f" | {max(times):.2f} |")


if __name__ == "__main__":
    main()
