"""Comparison 3, speed: training step, forward and greedy generation of the ~104M-parameter Llama-style
model at 1 and 2 devices, for the unsplit model, ours (in-process and torchrun), DTensor with the guide's
plan, transformers' tp_plan and tensor_parallel 2.0; all in one run, as ratios.

Every simulated device gets one thread: torch.set_num_threads(1) per process, and the in-process engines'
shard threads run one intra-op thread each, so on a 2-core machine 2 devices can at best halve a step.
Each number is the median of `repeats` (>= 5) timed calls after one warm-up call; the in-process systems
of one environment are timed in interleaved rounds. The unsplit model is timed again at the end of the run
to show how much the machine drifted. Targets that are missed get a profile (torch.profiler, every thread).

- train: forward + backward + AdamW step + zero_grad on a (batch, seq) token batch, language-model loss.
- forward: the same batch, no gradients (model.eval()).
- generate: greedy `generate` of `new_tokens` tokens after a `prompt`-token prompt, KV cache on.

    python benchmarks/speed.py [--quick] [--device cuda]         # writes benchmarks/results/speed.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from suite.launch import Checkpoints, Runner, comparison_main  # noqa: E402
from suite.targets import TARGETS  # noqa: E402

DISTRIBUTED = ("ours-torchrun", "dtensor", "hf-tp-plan")


def run(runner: Runner, checkpoints: Checkpoints) -> dict:
    ckpt = checkpoints.get()
    worlds = runner.sizes.speed_worlds
    out: dict = {"train": [], "infer": [], "failed": []}
    for task in ("train", "infer"):
        inprocess = ["plain", *(f"ours-inprocess:{n}" for n in worlds)]
        _collect(out, task, runner.job(task, inprocess, checkpoint=ckpt))
        for system in DISTRIBUTED:
            for n in worlds:
                if system == "hf-tp-plan" and n == 1:
                    continue  # tp_size=1 is the unsplit transformers model
                _collect(out, task, runner.job(task, [system], world=n, checkpoint=ckpt), system=system, world=n)
        peer = runner.job(task, ["plain", *(f"tensor_parallel:{n}" for n in worlds)], peer=True, checkpoint=ckpt)
        _collect(out, task, peer, rename={"plain": "plain (tensor_parallel env)"}, system="tensor_parallel")
        if "versions" in peer:
            out["peer_versions"] = peer["versions"]
    for task in ("train", "infer"):  # drift check: the unsplit model again, last
        _collect(out, task, runner.job(task, ["plain"], checkpoint=ckpt, tag="-end"), rename={"plain": "plain (end of run)"})
    out["profiles"] = profile_missed(runner, out, ckpt)
    out["tensor_parallel_on_main"] = runner.probe_peer_on_main()
    return out


def _collect(out: dict, task: str, result: dict, *, rename: dict | None = None, system: str = "", world: int = 0) -> None:
    if not result.get("ok"):
        out["failed"].append({"task": task, "system": system or "?", "world": world, "error": result.get("error", "?")})
        return
    for v in result["variants"]:
        if rename and v["system"] in rename:
            v["system"] = rename[v["system"]]
        out[task].append(v)


def profile_missed(runner: Runner, speed: dict, ckpt: str) -> dict:
    """Profile one call of each variant named by a missed target (rank 0 of torchrun jobs)."""
    wanted: dict[str, set[str]] = {"train": set(), "infer": set()}
    for target in TARGETS:
        if target.check(speed).get("met") is False:
            wanted[target.task].update(target.profile)
    profiles: dict = {}
    for task, variants in wanted.items():
        inprocess = sorted(v for v in variants if v.split(":")[0] not in DISTRIBUTED)
        if inprocess:
            result = runner.job(task, inprocess, checkpoint=ckpt, profile=True, repeats=1, tag="-profile")
            profiles.update({f"{task} {k}": p for k, p in result.get("profiles", {}).items()})
        for v in sorted(variants - set(inprocess)):
            system, _, n = v.partition(":")
            result = runner.job(task, [system], world=int(n), checkpoint=ckpt, profile=True, repeats=1, tag="-profile")
            profiles.update({f"{task} {k}": p for k, p in result.get("profiles", {}).items()})
    return profiles


if __name__ == "__main__":
    comparison_main(__doc__, "speed.json", run, lambda runner: f"speed: {runner.sizes.speed_worlds} devices, {runner.sizes.repeats} repetitions")
