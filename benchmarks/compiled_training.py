"""A training step compiled against the same step eager, for the unsplit model and for the model split in one
process or under torchrun: does torch.compile pay on a split model as it pays on an unsplit one?

    python benchmarks/compiled_training.py [--devices 2] [--rounds 5] [--steps 3] [--backend inductor] [--quick]
                                                        # writes benchmarks/results/compiled_training.json
    python benchmarks/compiled_training.py --torchrun   # also the torchrun rows (--devices gloo ranks)

Model: BENCHMARKS.md's small Llama (hidden 256, 8 layers, 8 query heads over 4 KV heads, vocabulary 2048;
suite/scaling_torchrun.py's "small"), a (4, 128) token batch, one intra-op thread per device (--quick: the tiny
Llama, to check that it runs). A step: the forward with labels (the language-model loss), backward, a plain
`torch.optim.AdamW(model.parameters())` step, zero_grad. Four variants: unsplit eager, unsplit `torch.compile`d,
split over `--devices` CPU slots eager, split `torch.compile(split)` (every shard compiled in its own thread:
engines/inprocess/compiled_shards.py). Each compiled variant first runs two untimed steps (compiling its forward and
backward graphs); then the variants take turns, `--steps` timed steps each per round, so every variant sees the
same machine; medians over the rounds.

With `--torchrun`, two more variants run in a torchrun job of `--devices` gloo ranks (one intra-op thread each):
`tp.parallelize` of the same model, eager and `torch.compile(model)` (the collectives as graph operators:
comm/dist_ops.py), interleaved the same way; a step's time is the slowest rank's (a barrier before each round).

Reported: each variant's step time (wall) and CPU time (all threads of the process; under torchrun rank 0's), the
compiled/eager ratio of the unsplit model and of the split one, and their quotient: the target is that the split
model's ratio is within 10% of the unsplit model's (quotient <= 1.10). Wall times need idle cores: run it alone, `uptime` near 0, and
compare runs by their `load_average` fields.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # inductor's worker pool slows later eager runs
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # suite/

import torch  # noqa: E402

BENCH = Path(__file__).resolve().parent


def build(quick: bool):
    from suite.scaling_torchrun import SPECS
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = SPECS["tiny" if quick else "small"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**spec.config)).train()
    batch = (2, 16) if quick else (4, 128)
    ids = torch.randint(0, spec.config["vocab_size"], batch, generator=torch.Generator().manual_seed(0))
    return spec.name, model, ids


class Variant:
    """A model, how it is called, its optimizer, and its timings."""

    def __init__(self, name: str, model, call, ids: torch.Tensor) -> None:
        self.name, self.model, self.call, self.ids = name, model, call, ids
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float] = []

    def step(self) -> None:
        loss = self.call(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.losses.append(loss.item())

    def timed(self, steps: int) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.step()
        self.wall.append((time.perf_counter() - wall) / steps)
        self.cpu.append((time.process_time() - cpu) / steps)


def warm_up_and_time(variants: list[Variant], rounds: int, steps: int, before_each=lambda: None) -> dict[str, float]:
    """Two untimed steps per variant (they compile the compiled variants' forward and backward, and recompile
    once), then `rounds` rounds of `steps` timed steps, the variants interleaved; `before_each` runs before every
    variant's steps (a barrier under torchrun). Returns each variant's seconds for its two untimed steps."""
    compile_seconds = {}
    for v in variants:
        before_each()
        started = time.perf_counter()
        v.step()
        v.step()
        compile_seconds[v.name] = round(time.perf_counter() - started, 2)
    for _ in range(rounds):
        for v in variants:
            before_each()
            v.timed(steps)
    return compile_seconds


def _torchrun_job(args) -> None:
    """One rank of the torchrun job: the split model eager and compiled, interleaved; rank 0 writes the result."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import tensorshard as tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    _, model, ids = build(args.quick)
    eager = tp.parallelize(copy.deepcopy(model), mesh)
    compiled = tp.parallelize(copy.deepcopy(model), mesh)
    variants = [Variant("torchrun split eager", eager, eager, ids),
                Variant("torchrun split compiled", compiled, torch.compile(compiled, backend=args.backend), ids)]
    compile_seconds = warm_up_and_time(variants, args.rounds, args.steps, before_each=dist.barrier)
    slowest = torch.tensor([statistics.median(v.wall) for v in variants], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        result = {"step_wall_s": {v.name: t for v, t in zip(variants, slowest.tolist())},
                  "step_cpu_s": {v.name: statistics.median(v.cpu) for v in variants},
                  "warmup_two_steps_s": compile_seconds, "losses": {v.name: v.losses for v in variants}}
        Path(args.out).write_text(json.dumps(result) + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--quick", action="store_true", help="the tiny Llama: checks that it runs")
    parser.add_argument("--out", default=str(BENCH / "results" / "compiled_training.json"))
    parser.add_argument("--torchrun", action="store_true", help="also the split model under torchrun")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return _torchrun_job(args)
    torch.set_num_threads(1)

    import tensorshard as tp

    spec, model, ids = build(args.quick)
    unsplit_eager = copy.deepcopy(model)
    unsplit_compiled = copy.deepcopy(model)
    split_eager = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * args.devices)
    split_compiled = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * args.devices)
    variants = [
        Variant("unsplit eager", unsplit_eager, unsplit_eager, ids),
        Variant("unsplit compiled", unsplit_compiled, torch.compile(unsplit_compiled, backend=args.backend), ids),
        Variant("split eager", split_eager, split_eager, ids),
        Variant("split compiled", split_compiled, torch.compile(split_compiled, backend=args.backend), ids),
    ]
    compile_seconds = warm_up_and_time(variants, args.rounds, args.steps)
    wall = {v.name: statistics.median(v.wall) for v in variants}
    cpu = {v.name: statistics.median(v.cpu) for v in variants}
    unsplit_ratio = wall["unsplit compiled"] / wall["unsplit eager"]
    split_ratio = wall["split compiled"] / wall["split eager"]
    result = {
        "model": spec, "batch": list(ids.shape), "devices": args.devices, "backend": args.backend,
        "rounds": args.rounds, "steps": args.steps, "torch": torch.__version__,
        "load_average": os.getloadavg(), "cpu_count": os.cpu_count(),
        "step_wall_s": wall, "step_cpu_s": cpu, "warmup_two_steps_s": compile_seconds,
        "unsplit_compiled_over_eager": unsplit_ratio, "split_compiled_over_eager": split_ratio,
        "split_ratio_over_unsplit_ratio": split_ratio / unsplit_ratio,
        "target_met": split_ratio / unsplit_ratio <= 1.10,
        "same_losses": all(
            abs(a - b) <= 1e-4 * abs(b) for v in variants[1:] for a, b in zip(v.losses, variants[0].losses)
        ),
    }
    if args.torchrun:
        from suite.scaling_torchrun import run_script

        job = ["--job", "--rounds", str(args.rounds), "--steps", str(args.steps), "--backend", args.backend]
        ran = run_script(Path(__file__).resolve(), job + (["--quick"] if args.quick else []), ranks=args.devices,
                         timeout=3600, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
        torchrun_ratio = ran["step_wall_s"]["torchrun split compiled"] / ran["step_wall_s"]["torchrun split eager"]
        wall.update(ran["step_wall_s"])
        cpu.update(ran["step_cpu_s"])
        compile_seconds.update(ran["warmup_two_steps_s"])
        result.update(step_wall_s=wall, step_cpu_s=cpu, warmup_two_steps_s=compile_seconds,
                      torchrun_split_compiled_over_eager=torchrun_ratio,
                      torchrun_ratio_over_unsplit_ratio=torchrun_ratio / unsplit_ratio,
                      torchrun_same_losses=all(abs(a - b) <= 1e-4 * abs(b) for losses in ran["losses"].values()
                                               for a, b in zip(losses, variants[0].losses)),
                      load_average_after_torchrun=os.getloadavg())
    for name in wall:
        print(f"{name:24s} step {wall[name] * 1e3:8.1f} ms wall, {cpu[name] * 1e3:8.1f} ms CPU; "
              f"first two steps {compile_seconds[name]:.1f} s")
    print(f"compiled/eager: unsplit {unsplit_ratio:.3f}, split {split_ratio:.3f} "
          f"(split / unsplit {split_ratio / unsplit_ratio:.3f}; target <= 1.10); load average {os.getloadavg()}")
    if args.torchrun:
        print(f"compiled/eager under torchrun: {result['torchrun_split_compiled_over_eager']:.3f} "
              f"(/ unsplit {result['torchrun_ratio_over_unsplit_ratio']:.3f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
