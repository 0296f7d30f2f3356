"""Greedy decoding per token, in one process: unsplit and split, eager and on the fast path (static cache + compile).

    TORCHINDUCTOR_COMPILE_THREADS=1 python benchmarks/generation.py [--model small|smollm] [--devices 1 2 4 8]
        [--rounds 5] [--skip "per shard"] [--balance] [--quick]
        # writes benchmarks/results/generation.json (generation-smollm.json for --model smollm) and prints a
        # markdown table (BENCHMARKS.md, section 5)
    python benchmarks/generation.py --device cuda --model smollm --devices 1 2 --rounds 3
        # the same on GPUs (cuda:0 .. cuda:N-1; N at most the visible GPUs): generation-smollm-cuda.json

Two models (benchmarks/suite/decoding_models.py): "small", a Llama of hidden 256 and 8 layers, the regime GPU
decoding lives in, where a token is Python and dispatch, not arithmetic; "smollm", SmolLM2-135M's shape with random
weights, where a token reads ~540 MB of weights (bound by memory bandwidth, the regime tensor parallelism is for).
Batch 1, a 16-token prompt, 32 new tokens, greedy, one intra-op thread per device. What is timed, per generated token
(the whole `generate` call / 32, its prefill included):

- unsplit eager: `model.generate(...)` with the dynamic cache;
- unsplit fast: transformers' own fast path, `cache_implementation="static"` with its compile forced on CPU
  (`CompileConfig._compile_all_devices`; transformers compiles by itself only on GPUs), one intra-op thread;
- unsplit fast, N threads: the same on a copy of the model compiled and run under `torch.set_num_threads(N)`, for
  each device count N > 1: the split rows use N cores, so the unsplit model gets them too (inductor's kernels are
  built for the thread count of their compile, hence a copy of their own);
- split default: `tp.tensor_parallel(model, ["cpu"] * n).generate(...)` with the dynamic cache;
- split fast: the same split model with `cache_implementation="static"`: on CPU slots, after two tokens, every
  shard's step stitched into one compiled graph run from the calling thread, or, for a model that reads enough
  weights between two collectives, each shard's compiled graph on its own thread at the same time as the others'
  (engines/inprocess/stitched_decode.py chooses; its log line says which);
- split fast per shard: the fast path as it was before stitching, each shard's own compiled graph in its thread
  (`keep_one_graph_per_shard`), on a copy of the split model;
- with `--balance`, split balanced default / fast: the same two rows on `tp.tensor_parallel(..., balance=True)`
  (plans/balance.py: the MLP evens out each device's weights where the heads split unevenly, as SmolLM2's 3 KV heads
  over 2 devices), timed in the same interleaved rounds as the even split.

With `--device cuda` the rows are the GPU's: unsplit eager and unsplit fast on cuda:0 (transformers' own fast path
there: static cache + `CompileConfig()`, whose mode is "reduce-overhead", CUDA graphs), and per device count N split
over cuda:0 .. cuda:N-1: default, fast (static cache, each shard compiled, no CUDA graphs), and fast with CUDA graphs
(`CompileConfig(mode="reduce-overhead")`: each shard's step captured in CUDA graphs cut at its collectives,
engines/inprocess/cuda_graph_mode.py). The N-thread and per-shard rows are CPU rows, left out; wall times are
taken after `torch.cuda.synchronize()`.

Every variant runs in one process, in interleaved rounds (the same conditions for all), after one untimed call
that compiles (its time is reported as "first call"). Wall time is the median over the rounds; CPU time is the
process's, summed over its threads. Inductor's compile workers slow later eager code, so set
TORCHINDUCTOR_COMPILE_THREADS=1 (the script does, unless it is set).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # suite/

from suite.decoding_models import DESCRIPTIONS, build, gpu_shortage  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def results_file(model: str, device: str = "cpu") -> Path:
    """Where a run on `model` writes its JSON: generation.json for the small Llama, as before the other models;
    a GPU run's name ends in -cuda."""
    stem = "generation" if model == "small" else f"generation-{model}"
    return RESULTS / (f"{stem}.json" if device == "cpu" else f"{stem}-{device}.json")


def device_problem(device: str, devices: list[int], gpus: int) -> str | None:
    """Why `--device`/`--devices` cannot run with `gpus` visible GPUs (None: they can)."""
    return gpu_shortage(device, "--devices", devices, gpus,
                        "the split rows need as many GPUs as devices (one GPU appears once in a device list)")


def cuda_variants(model, devices: list[int]):
    """The `--device cuda` rows (see the module doc): name -> (model, generate's extra arguments, threads)."""
    from transformers import CompileConfig

    import tensorshard as tp

    graphs = {"cache_implementation": "static", "compile_config": CompileConfig(mode="reduce-overhead")}
    out = {"unsplit eager": (copy.deepcopy(model).to("cuda:0"), {}, 1)}
    out["unsplit fast"] = (out["unsplit eager"][0], {"cache_implementation": "static", "compile_config": CompileConfig()}, 1)
    for n in devices:
        split = tp.tensor_parallel(copy.deepcopy(model), [f"cuda:{i}" for i in range(n)])
        out[f"split {n} default"] = (split, {}, 1)
        out[f"split {n} fast"] = (split, {"cache_implementation": "static"}, 1)
        out[f"split {n} fast CUDA graphs"] = (split, graphs, 1)
    return out


def unsplit_fast_kwargs() -> dict:
    """generate's extra arguments for the unsplit model's fast path on CPU: the static cache and transformers' own
    compile, forced off-GPU (benchmarks/first_call.py too)."""
    from transformers import CompileConfig

    compile_anywhere = CompileConfig()
    compile_anywhere._compile_all_devices = True  # transformers' own switch for compiling off-GPU
    return {"cache_implementation": "static", "compile_config": compile_anywhere}


def variants(model, devices: list[int], balance: bool = False):
    """name -> (the model to call, generate's extra arguments, intra-op threads), for the unsplit model and each
    split."""
    import torch
    from transformers import CompileConfig

    import tensorshard as tp
    from tensorshard.integrations.transformers.fast_decode import compiled_call

    fast = unsplit_fast_kwargs()
    out = {"unsplit eager": (model, {}, 1), "unsplit fast": (model, fast, 1)}
    for n in sorted({n for n in devices if n > 1}):  # a copy: its graphs are compiled for n threads
        out[f"unsplit fast {n} threads"] = (copy.deepcopy(model), fast, n)
    for n in devices:
        split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * n)
        out[f"split {n} default"] = (split, {}, 1)
        out[f"split {n} fast"] = (split, {"cache_implementation": "static"}, 1)
        if n > 1:
            per_shard = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * n)
            compiled_call(per_shard, None).keep_one_graph_per_shard()
            out[f"split {n} fast per shard"] = (per_shard, {"cache_implementation": "static"}, 1)
        if n > 1 and balance:
            balanced = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * n, balance=True)
            out[f"split {n} balanced default"] = (balanced, {}, 1)
            out[f"split {n} balanced fast"] = (balanced, {"cache_implementation": "static"}, 1)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(DESCRIPTIONS), default="small",
                        help="small: dispatch-bound Llama; smollm: SmolLM2-135M's shape (weights-bound)")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 devices, 2 rounds: checks that it runs")
    parser.add_argument("--skip", nargs="+", default=[], metavar="WORDS",
                        help='leave out the variants whose name contains any of these, e.g. --skip "per shard" (each '
                             "compiled variant costs minutes of compile on the smollm shape)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: CPU slots (the default); cuda: the GPU rows (--devices N: cuda:0 .. cuda:N-1)")
    parser.add_argument("--balance", action="store_true",
                        help="also time each split with balance=True (its default and fast rows, CPU slots)")
    args = parser.parse_args(argv)
    import torch

    if args.quick:  # (on GPUs: 2 devices where 2 are visible, else 1)
        args.model, args.rounds, args.new_tokens = "tiny", 2, 8
        args.devices = [2] if args.device == "cpu" else [max(1, min(2, torch.cuda.device_count()))]
    problem = device_problem(args.device, args.devices, torch.cuda.device_count())
    if problem is not None:
        parser.error(problem)

    torch.set_num_threads(1)
    model = build(args.model)
    cuda = args.device == "cuda"
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    new = args.new_tokens
    every = cuda_variants(model, args.devices) if cuda else variants(model, args.devices, args.balance)
    runs = {name: run for name, run in every.items()
            if name in ("unsplit eager", "unsplit fast") or not any(word in name for word in args.skip)}
    reference = None
    first, wall, cpu, same = {}, {k: [] for k in runs}, {k: [] for k in runs}, {}

    def generate(name):
        m, kwargs, threads = runs[name]
        torch.set_num_threads(threads)
        try:
            with torch.no_grad():
                x = ids.to(m.device)
                out = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, **kwargs)
                if cuda:
                    torch.cuda.synchronize()
                return out.cpu()
        finally:
            torch.set_num_threads(1)

    for name in runs:  # the untimed first call: compiles where the variant compiles
        started = time.perf_counter()
        tokens = generate(name)
        first[name] = time.perf_counter() - started
        reference = tokens if reference is None else reference
        same[name] = bool(torch.equal(tokens, reference))
        print(f"{name}: first call {first[name]:.1f} s, tokens {'equal' if same[name] else 'DIFFER'}", file=sys.stderr)
    for _ in range(args.rounds):
        for name in runs:
            c, w = time.process_time(), time.perf_counter()
            generate(name)
            wall[name].append((time.perf_counter() - w) / new * 1e3)
            cpu[name].append((time.process_time() - c) / new * 1e3)
    rows = {
        name: {"ms_per_token": statistics.median(wall[name]), "cpu_ms_per_token": statistics.median(cpu[name]),
               "first_call_s": first[name], "same_tokens": same[name]}
        for name in runs
    }
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "load_at_start": os.getloadavg()[0],
        "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "model": args.model, "new_tokens": new, "rounds": args.rounds, "rows": rows,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
    }
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        results_file(args.model, args.device).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


def table(result: dict) -> str:
    rows = result["rows"]
    eager, fast = rows["unsplit eager"]["ms_per_token"], rows["unsplit fast"]["ms_per_token"]
    lines = [
        f"{result['date']}, {result.get('device', 'cpu')}, {result['cores']} cores, load {result['load_at_start']:.1f} at the start, torch {result['torch']}, "
        f"{DESCRIPTIONS.get(result['model'], result['model'])}, {result['new_tokens']} new tokens, "
        f"medians of {result['rounds']} rounds; split rows: one intra-op thread per device",
        "",
        "| variant | ms/token | x unsplit eager | x unsplit fast | CPU ms/token | first call (s) | tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['ms_per_token']:.1f} | {r['ms_per_token'] / eager:.2f} | {r['ms_per_token'] / fast:.2f} | "
            f"{r['cpu_ms_per_token']:.1f} | {r['first_call_s']:.1f} | {'same' if r['same_tokens'] else 'DIFFER'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
