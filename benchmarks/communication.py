"""Comparison 2, communication: collectives and bytes per transformer block, forward and backward (and one
greedy decode step with the KV cache), for each system's plan, at 2 devices.

Each system runs the Llama-style model (suite/config.py sizes, (batch, seq) training tokens) built with 1
and with 2 decoder layers; the difference is the cost of one block, the rest is the model's ends
(embedding, output head, loss, and for our in-process engine the one ZeRO-3 gather per call). Counted by
tensorshard's `count_collectives` (ours), torch's `CommDebugMode` (every torchrun-based system, ours
included, as a cross-check) and, for tensor_parallel 2.0, by wrapping its collective objects
(suite/peer_job.py). Bytes: the size of each collective's result per device.

    python benchmarks/communication.py [--quick]                 # writes benchmarks/results/comm.json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from suite.launch import Checkpoints, Runner, add_arguments, environment_info, runner_from, write_json  # noqa: E402

WORLD = 2
SYSTEMS = ("ours-inprocess", "ours-torchrun", "dtensor", "hf-tp-plan", "tensor_parallel")


def run(runner: Runner, checkpoints: Checkpoints) -> dict:
    runs = []
    for system in SYSTEMS:
        for layers in (1, 2):
            spec = [f"{system}:{WORLD}"] if system in ("ours-inprocess", "tensor_parallel") else [system]
            result = runner.job("comm", spec, world=WORLD, layers=layers, peer=system == "tensor_parallel",
                                checkpoint=checkpoints.get(layers) if system == "hf-tp-plan" else None)
            runs.append({**result, "system": system, "world": WORLD, "layers": layers})
    return {"runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    runner = runner_from(args)
    print(f"communication: {WORLD} devices, {'quick' if args.quick else 'full'} sizes")
    meta = environment_info(runner)
    with Checkpoints(runner) as checkpoints:
        result = run(runner, checkpoints)
    meta["load_average_end"] = os.getloadavg()
    write_json(Path(args.results) / "comm.json", {"meta": meta, "sizes": runner.sizes.to_dict(), **result, "jobs": runner.log})


if __name__ == "__main__":
    main()
