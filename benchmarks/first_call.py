"""The first fast decode call (the one that compiles), each variant in a fresh process: wall time, CPU time, phases.

    TORCHINDUCTOR_COMPILE_THREADS=1 python benchmarks/first_call.py --model smollm --cache warm
    python benchmarks/first_call.py --model smollm --cache cold --variants unsplit inprocess
    python benchmarks/first_call.py --quick        # the tiny Llama, warm: a check that it runs
    python benchmarks/first_call.py --cache cold --cache-dir /tmp/fc && \
        python benchmarks/first_call.py --cache warm --cache-dir /tmp/fc   # cold, then warm on what cold filled

Variants (the models of benchmarks/suite/decoding_models.py, batch 1, a 16-token prompt, 32 new tokens, greedy,
one intra-op thread per process or device, as benchmarks/generation.py and generation_torchrun.py time them):

- unsplit: transformers' own fast path (`cache_implementation="static"`, its compile forced on CPU), one process;
- inprocess: `tp.tensor_parallel(model, ["cpu"] * N)` (`--devices`, 2 by default) on the fast path, one process;
- torchrun: `tp.parallelize` over N gloo ranks (torchrun), the fast path (the slowest rank's wall time).

Each variant runs in a process of its own, with a private inductor cache (TORCHINDUCTOR_CACHE_DIR) and a private
tensorshard cache (TENSORSHARD_CACHE_DIR: the native collectives' library, the decode captures kept on disk by the
first process: docs/generation.md, "Captures kept on disk"): `--cache cold` times the first process
on the empty caches; `--cache warm` runs one process first to fill them, then times a second. Only the first fast
`generate` call is timed (from just before it to just after it): the process start, the imports, building and
splitting the model are not. Printed per variant: wall time, the process's CPU time (all its threads), the CPU
time of its finished child processes (inductor's C++ compiler runs; in one process also the shards' traces,
made in forked children: docs/generation.md), and the phases: dynamo's cumulative phase
times (`torch._dynamo.utils.calculate_time_spent()`: its own tracing, AOT autograd, inductor's compile; nested
phases are included in their parents), inductor's FX-graph cache hits / misses and AOT-autograd cache hits,
the bytecodes dynamo traced, the graphs it made, and tensorshard's own compile log lines (INFO). Under torchrun
every figure is rank 0's but the wall time, CPU times and bytecodes, which are given per rank.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))  # suite/, generation.py

from generation import unsplit_fast_kwargs  # noqa: E402
from suite.decoding_models import DESCRIPTIONS, MODELS, build  # noqa: E402
from suite.scaling_torchrun import run_script  # noqa: E402

VARIANTS = ("unsplit", "inprocess", "torchrun")
# dynamo's phases worth a column (calculate_time_spent's keys; a phase includes the ones nested in it)
PHASES = ("entire_frame_compile", "backend_compile", "inductor_compile", "code_gen", "async_compile.wait")


# --- inside a job (one process, or every rank of a torchrun job) ------------------------------------------


class _Lines(logging.Handler):
    """Keeps the messages of tensorshard's INFO records."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _job(args) -> None:
    import torch

    torch.set_num_threads(1)
    ranks = args.variant == "torchrun"
    if ranks:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        import tensorshard as tp

        dist.init_process_group("gloo")
        model = tp.parallelize(build(args.model), init_device_mesh("cpu", (dist.get_world_size(),)))
        extra = {"cache_implementation": "static"}
    elif args.variant == "inprocess":
        import tensorshard as tp

        model, extra = tp.tensor_parallel(build(args.model), ["cpu"] * args.devices), {"cache_implementation": "static"}
    else:
        model, extra = build(args.model), unsplit_fast_kwargs()
    prompt = torch.randint(0, MODELS[args.model]["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(1))
    lines = _Lines()
    library = logging.getLogger("tensorshard")
    library.addHandler(lines)
    library.setLevel(logging.INFO)
    traced = _count_bytecodes()
    if ranks:
        dist.barrier()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new, min_new_tokens=args.new,
                       do_sample=False, pad_token_id=0, **extra)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    from torch._dynamo.utils import calculate_time_spent, counters

    mine = {"wall_s": wall, "cpu_s": cpu,
            "children_cpu_s": (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime),
            "bytecodes": sum(traced.values()), "call_impl_bytecodes": traced.get("_call_impl", 0)}
    spent = calculate_time_spent()
    result = {
        "load": os.getloadavg()[0],
        "phases_s": {k: round(v, 2) for k, v in spent.items()},
        "cache": {k: int(counters["inductor"][k]) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")}
        | {"aot_autograd_cache_hit": int(counters["aot_autograd"]["autograd_cache_hit"])},
        "graphs": int(counters["stats"]["unique_graphs"]),
        "log": [line for line in lines.lines if "compil" in line or "stitch" in line or "kept on disk" in line],
    }
    if ranks:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        result["ranks"] = every
        dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return
    else:
        result["ranks"] = [mine]
    with open(args.out, "w") as f:
        json.dump(result, f)


def _count_bytecodes() -> dict[str, int]:
    """Counts the bytecodes dynamo traces from now on, per function name (a wrapper around its translator's `step`,
    where this torch has one; tests/engines/test_class_forwards.py counts them the same way)."""
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase as translator

    traced: dict[str, int] = {}
    step = getattr(translator, "step", None)
    if step is None:
        return traced

    def counting(self):
        name = self.f_code.co_name
        traced[name] = traced.get(name, 0) + 1
        return step(self)

    translator.step = counting
    return traced


# --- the launcher ---------------------------------------------------------------------------------------


def measure(variant: str, *, model: str, cache: str, devices: int = 2, new: int = 32, timeout: float = 1800,
            folder: str | None = None) -> dict:
    """The first fast call of `variant` in a fresh process (see the module doc), with caches as `cache` says: new
    private ones, or those under `folder` (kept; a warm run fills them first only where they are not there yet:
    inductor's, or a split model's kept captures)."""
    if folder is None:
        with tempfile.TemporaryDirectory(prefix="tensorshard-first-call-") as folder:
            return measure(variant, model=model, cache=cache, devices=devices, new=new, timeout=timeout, folder=folder)
    inductor = os.path.join(folder, "inductor")
    env = {"TORCHINDUCTOR_CACHE_DIR": inductor, "TENSORSHARD_CACHE_DIR": os.path.join(folder, "tensorshard"),
           "TORCHINDUCTOR_COMPILE_THREADS": os.environ["TORCHINDUCTOR_COMPILE_THREADS"]}
    args = ["--job", variant, "--model", model, "--devices", str(devices), "--new", str(new)]
    ranks = devices if variant == "torchrun" else 0
    kept = os.path.join(folder, "tensorshard", "captures")  # (a split model's decode captures: none unsplit)
    if cache == "warm" and (not os.path.isdir(inductor) or (variant != "unsplit" and not os.path.isdir(kept))):
        run_script(HERE, args, ranks=ranks, timeout=timeout, env=env)
    return run_script(HERE, args, ranks=ranks, timeout=timeout, env=env)


def table(results: dict[str, dict], *, model: str, cache: str, devices: int, load: float) -> str:
    lines = [
        f"{DESCRIPTIONS[model]}, {devices} devices / ranks, first fast `generate` (32 new tokens), inductor's cache "
        f"{cache}, load {load:.2f} at the start; CPU: the process's (per rank under torchrun) + its child processes' (C++ compiler runs, forked traces)",
        "",
        "| variant | wall (s) | CPU (s) | child processes CPU (s) | " + " | ".join(PHASES) + " | FX cache hit/miss/bypass | graphs | bytecodes (`_call_impl`'s) |",
        "|---|---:|---:|---:|" + "---:|" * len(PHASES) + "---|---:|---:|",
    ]
    for name, r in results.items():
        ranks = r["ranks"]
        wall = max(x["wall_s"] for x in ranks)
        cpu = " / ".join(f"{x['cpu_s']:.1f}" for x in ranks)
        children = " / ".join(f"{x['children_cpu_s']:.1f}" for x in ranks)
        phases = " | ".join(f"{r['phases_s'].get(k, 0):.1f}" for k in PHASES)
        c = r["cache"]
        hits = f"{c['fxgraph_cache_hit']}/{c['fxgraph_cache_miss']}/{c['fxgraph_cache_bypass']}"
        codes = " / ".join(f"{x['bytecodes']} ({x['call_impl_bytecodes']})" for x in ranks)
        lines.append(f"| {name} | {wall:.1f} | {cpu} | {children} | {phases} | {hits} | {r['graphs']} | {codes} |")
    for name, r in results.items():
        for line in r["log"]:
            lines.append(f"- {name}: {line}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm")
    parser.add_argument("--cache", choices=["warm", "cold"], default="warm",
                        help="warm: one process fills a private inductor cache, a second is timed; cold: an empty one")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--devices", type=int, default=2, help="devices (in-process) and ranks (torchrun) of the split")
    parser.add_argument("--new", type=int, default=32, help="new tokens of the timed call")
    parser.add_argument("--quick", action="store_true", help="the tiny Llama, 4 new tokens: a check that it runs")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="keep each variant's caches under DIR/VARIANT instead of a new private folder: a cold run "
                             "there, then a warm one, times both for one fill (a warm run fills them only if missing)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    parser.add_argument("--job", choices=VARIANTS, dest="variant", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:
        return _job(args)
    if args.quick:
        args.model, args.new = "tiny", 4
    if args.devices < 2:
        parser.error(f"--devices {args.devices}: a split needs at least 2")
    for variant in args.variants if args.cache_dir and args.cache == "cold" else ():
        if os.path.exists(os.path.join(args.cache_dir, variant, "inductor")):
            parser.error(f"--cache cold --cache-dir {args.cache_dir}: {variant}'s caches are there already; "
                         "name a new folder (or --cache warm to reuse them)")
    load = os.getloadavg()[0]
    results = {}
    for variant in args.variants:
        folder = os.path.join(args.cache_dir, variant) if args.cache_dir else None
        results[variant] = measure(variant, model=args.model, cache=args.cache, devices=args.devices, new=args.new,
                                   timeout=args.timeout, folder=folder)
        print(f"{variant}: {max(x['wall_s'] for x in results[variant]['ranks']):.1f} s", file=sys.stderr, flush=True)
    print(table(results, model=args.model, cache=args.cache, devices=args.devices, load=load))
    print(f"load average after: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
