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

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from suite.launch import Checkpoints, Runner, comparison_main  # noqa: E402

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


if __name__ == "__main__":
    comparison_main(__doc__, "comm.json", run, lambda runner: f"communication: {WORLD} devices")
