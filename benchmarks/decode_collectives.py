"""A compiled decode step under torchrun, its collectives as the native C++ operators or as the Python ones.

    torchrun --nproc_per_node=2 benchmarks/decode_collectives.py              # small Llama, 4 rounds each
    torchrun --nproc_per_node=2 benchmarks/decode_collectives.py --rounds 6 --new 64

One job, one split model (the small Llama of benchmarks/generation_torchrun.py, random weights, batch 1, greedy,
prompt of 16 tokens, static cache, one intra-op thread per rank). Its decode step is compiled twice: once
calling the native collectives (comm/native/), once with the group's native handle taken away, so dynamo
compiles it again with comm/dist_ops.py's Python operators (what compiled graphs called before). Both give the
same tokens (checked). Then the two run in interleaved rounds (A B B A ...), so load that comes and goes on a
shared machine falls on both alike. Per token: the median gap between consecutive tokens of one generate(), and
the CPU time of this rank's process over the same gaps (which load blurs less than wall time); medians over
rounds, per rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

import tensorshard as tp

SMALL = dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4)


class Stamps(LogitsProcessor):
    """The wall and CPU time at each token."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []

    def __call__(self, input_ids, scores):
        self.times.append((time.perf_counter(), time.process_time()))
        return scores


def generate(model, ids, new: int) -> tuple[list, float, float]:
    """Tokens, median wall ms and median CPU ms per decode step (the first gap, after the prefill, left out)."""
    stamps = Stamps()
    dist.barrier()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, cache_implementation="static",
                             pad_token_id=0, logits_processor=LogitsProcessorList([stamps]))
    pairs = list(zip(stamps.times[1:], stamps.times[2:]))
    wall = statistics.median(b[0] - a[0] for a, b in pairs) * 1e3
    cpu = statistics.median(b[1] - a[1] for a, b in pairs) * 1e3
    return out.tolist(), wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="timed generate() calls per variant")
    parser.add_argument("--new", type=int, default=32, help="new tokens per generate()")
    args = parser.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same model and prompt on every rank
    model = tp.parallelize(LlamaForCausalLM(LlamaConfig(**SMALL)).eval(), init_device_mesh("cpu", (world,)))
    ids = torch.randint(0, SMALL["vocab_size"], (1, 16))
    guard = model.tensorshard.comm.guard
    native_tokens = generate(model, ids, args.new)[0]  # compiles the step with the native collectives
    handle = guard.native
    if handle is None:
        raise SystemExit("the native collectives are not in use here (see the log: no compiler, or not one host)")
    variants = {"native op": handle, "python op": None}
    guard.native = None
    python_tokens = generate(model, ids, args.new)[0]  # dynamo compiles it again, with the Python operators
    if native_tokens != python_tokens:
        raise SystemExit("the two compiled steps gave different tokens")
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            guard.native = variants[name]
            results[name].append(generate(model, ids, args.new)[1:])
    guard.native = handle
    everyone: list = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        load = os.getloadavg()
        print(f"{os.cpu_count()} cores, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}; torch {torch.__version__}; "
              f"{world} ranks, {args.new} new tokens, {args.rounds} rounds per variant")
        print("| collectives | rank | ms per token, median (rounds) | CPU ms per token |")
        print("|---|---:|---:|---:|")
        for name in variants:
            for r, per_rank in enumerate(everyone):
                walls = [w for w, _ in per_rank[name]]
                cpus = [c for _, c in per_rank[name]]
                print(f"| {name} | {r} | {statistics.median(walls):.2f} ({', '.join(f'{w:.1f}' for w in walls)}) | "
                      f"{statistics.median(cpus):.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
