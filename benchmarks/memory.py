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

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from suite.launch import Checkpoints, Runner, add_arguments, environment_info, runner_from, write_json  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    runner = runner_from(args)
    print(f"memory: {runner.sizes.worlds} devices, {'quick' if args.quick else 'full'} sizes")
    meta = environment_info(runner)
    with Checkpoints(runner) as checkpoints:
        result = run(runner, checkpoints)
    meta["load_average_end"] = os.getloadavg()
    write_json(Path(args.results) / "memory.json", {"meta": meta, "sizes": runner.sizes.to_dict(), **result, "jobs": runner.log})


if __name__ == "__main__":
    main()
