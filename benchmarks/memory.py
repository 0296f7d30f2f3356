"""Comparison 1, memory scaling: per-device memory during a training step at 1, 2, 4 and 8 devices.

Models: the Lightning guide's FeedForward(8192, 8192) (the guide reports 4.04 / 2.03 / 1.02 / 0.60 GB per
GPU) and the ~104M-parameter Llama-style model (suite/config.py). Systems: the unsplit model; ours, both
engines; PyTorch DTensor with the guide's plan; transformers' tp_plan (Llama); tensor_parallel 2.0.

What is measured, per device (a CPU slot of an in-process engine, or one process): the bytes of its
parameters, gradients and AdamW state (local shards), plus the activations autograd saved for backward
during its forward, after one warm-up step; and, per process, the resident memory (peak during the
measured step). On GPUs (--device cuda), also torch.cuda.max_memory_allocated per device.

    python benchmarks/memory.py [--quick] [--device cuda]        # writes benchmarks/results/memory.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from suite.launch import Checkpoints, Runner, comparison_main  # noqa: E402

SYSTEMS = ("plain", "ours-inprocess", "ours-torchrun", "dtensor", "hf-tp-plan", "tensor_parallel")


def run(runner: Runner, checkpoints: Checkpoints) -> dict:
    runs = []
    for model in ("ff", "llama"):
        checkpoint = checkpoints.get() if model == "llama" else None
        for system in SYSTEMS:
            worlds = (1,) if system == "plain" else runner.sizes.worlds
            for world in worlds:
                if system == "hf-tp-plan" and model == "ff":
                    runs.append({"model": model, "system": system, "world": world, "ok": False, "skipped": True,
                                 "error": "not applicable: transformers' tp_plan splits transformers models only"})
                    continue
                if system in ("ours-inprocess", "tensor_parallel"):
                    spec = [f"{system}:{world}"]
                else:
                    spec = [system]
                result = runner.job("memory", spec, model=model, world=world, peer=system == "tensor_parallel",
                                    checkpoint=checkpoint)
                runs.append({"model": model, **result, "system": system, "world": world})
    return {"runs": runs}


if __name__ == "__main__":
    comparison_main(__doc__, "memory.json", run, lambda runner: f"memory: {runner.sizes.worlds} devices")
