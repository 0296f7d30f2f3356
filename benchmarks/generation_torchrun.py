"""Greedy decoding per token under the torchrun engine: the unsplit model and the split one, each on its default
path and on the fast path (static cache + compiled decode step), with the first call's (compile) time.

    python benchmarks/generation_torchrun.py                 # small Llama, 2 ranks, 32 new tokens, 5 rounds
    python benchmarks/generation_torchrun.py --ranks 2 4     # more rank counts
    python benchmarks/generation_torchrun.py --model smollm  # SmolLM2-135M's shape, random weights (weights-bound)
    python benchmarks/generation_torchrun.py --quick         # a tiny Llama, 1 round: a check that it runs
    python benchmarks/generation_torchrun.py --model smollm --balance  # + the split rows with balance=True
    python benchmarks/generation_torchrun.py --model smollm --wrappers  # + the split fast row on the Python wrapper
    python benchmarks/generation_torchrun.py --device cuda --model smollm --ranks 2   # GPUs: one per rank, NCCL

Rows, all `generate(prompt, do_sample=False)` on the same random Llama (seed 0, batch 1, prompt of 16 tokens; the
models are benchmarks/suite/decoding_models.py's):

- unsplit eager: one process, transformers' default (dynamic cache, no compile)
- unsplit fast: one process, `cache_implementation="static"` and transformers' compiled decode step, forced on
  CPU (`CompileConfig._compile_all_devices = True`: transformers compiles by itself on CUDA only), one intra-op
  thread
- unsplit fast, N threads: the same process alone with N intra-op threads (`torch.set_num_threads(N)` before its
  compile), for each rank count N: the N ranks use N cores, so the unsplit model gets them too
- split default: `tp.parallelize` over N gloo ranks (torchrun), dynamic cache, no compile
- split fast: the same model, `cache_implementation="static"`: the engine compiles the decode step itself
  (engines/torchrun/decoding.py), collectives inside the graph (the native C++ operators of comm/native/;
  with TENSORSHARD_NATIVE=0, comm/dist_ops.py's Python operators, as before them; benchmarks/decode_collectives.py
  compares the two in one job)
- with `--wrappers`, split fast, Python wrapper: the same job's fast path with TENSORSHARD_CPP_WRAPPER=0 between its
  calls (engines/torchrun/cpp_step.py: later tokens then run inductor's Python-wrapper graph instead of the C++ one,
  which a kind gets after 64 tokens: two fast calls of warm-up go past that), interleaved with the other rows' rounds
- with `--balance`, split balanced default / fast: a job of its own with `tp.parallelize(..., balance=True)`
  (plans/balance.py: the MLP evens out each rank's weights where the heads split unevenly)

With `--device cuda` every process runs on its GPU (rank r on cuda:r, an NCCL group; ranks at most the visible
GPUs: NCCL refuses two ranks on one GPU) and the fast rows are transformers' CUDA path: static cache and
`CompileConfig()` (mode "reduce-overhead": the decode step captured in CUDA graphs, its collectives inside them as
NCCL calls, comm/graph_collectives.py). The N-thread rows are CPU rows, left out.

Per token: the decode steps only, the median gap between consecutive tokens of one generate() (a logits
processor notes the time of each), then the median over rounds; split rows take the slowest rank's (a barrier
before each call, the maximum over ranks after). CPU per token: the same gaps on the calling thread's CPU clock
(`time.thread_time`; for split rows the larger of the ranks'). First call: the first fast generate() of `new` tokens, compile
included. Each process uses one intra-op thread, and TORCHINDUCTOR_COMPILE_THREADS=1 (inductor's compile
workers slow every later eager run of the process). The greedy tokens of every row are compared with the
unsplit eager ones. The load average is printed: on a shared machine the times are only as good as it is low.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))  # suite/

from suite.decoding_models import DESCRIPTIONS, MODELS, build, gpu_shortage  # noqa: E402
from suite.scaling_torchrun import run_script  # noqa: E402


# --- inside a job (one process, or every rank of a torchrun job) ------------------------------------------


class _StepClock:
    """A logits processor that notes the time of each generated token: the gaps are the decode steps."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        self.cpu.append(time.thread_time())
        return scores

    def intervals(self, cpu: bool = False) -> list[float]:
        times = self.cpu if cpu else self.times
        return [b - a for a, b in zip(times, times[1:])]


def _job(args) -> None:
    import torch
    from transformers import LogitsProcessorList

    from transformers import CompileConfig

    torch.set_num_threads(args.threads)
    split, cuda = args.split, args.device == "cuda"
    if split:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        import tensorshard as tp

        dist.init_process_group("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        model = build(args.model)
        mesh = init_device_mesh(args.device, (dist.get_world_size(),))
        model = tp.parallelize(model.cuda() if cuda else model, mesh, balance=args.balanced)
    else:
        model = build(args.model).to(args.device)
    prompt = torch.randint(0, MODELS[args.model]["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(args.device)
    fast = dict(cache_implementation="static")
    if cuda:
        fast["compile_config"] = CompileConfig()  # mode "reduce-overhead": CUDA graphs, as transformers on CUDA
    elif not split:
        config = CompileConfig()
        config._compile_all_devices = True  # transformers' fast path, which it takes by itself on CUDA only
        fast["compile_config"] = config
    paths = {"default": {}, "fast": fast}
    if split and args.wrappers:
        paths["fast_python_wrapper"] = fast  # (with TENSORSHARD_CPP_WRAPPER=0 around the call)

    def timed(extra: dict, python_wrapper: bool = False) -> tuple[float, float, float, list]:
        """One generate(): its wall time, the median time and CPU time between decode steps, and the new tokens."""
        clock = _StepClock()
        if split:
            dist.barrier()
        if python_wrapper:
            os.environ["TENSORSHARD_CPP_WRAPPER"] = "0"
        began = time.perf_counter()
        try:
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=args.new, do_sample=False, pad_token_id=0,
                                     logits_processor=LogitsProcessorList([clock]), **extra)
        finally:
            os.environ.pop("TENSORSHARD_CPP_WRAPPER", None)
        if cuda:
            torch.cuda.synchronize()
        took, step = time.perf_counter() - began, statistics.median(clock.intervals())
        cpu = statistics.median(clock.intervals(cpu=True))
        if split:  # the slowest rank's times
            slowest = torch.tensor([took, step, cpu], dtype=torch.float64, device=args.device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            took, step, cpu = slowest.tolist()
        return took, step, cpu, out[0, args.prompt:].tolist()

    result = {"load_before": os.getloadavg()[0]}
    result["first_call_s"], _, _, _ = timed(fast)  # compiles the decode step
    timed(paths["default"])  # warm-up
    for _ in range(2):  # ... and past 64 tokens of the fast kind: under torchrun its C++-wrapper graph is built then
        timed(fast)  # (engines/torchrun/cpp_step.py BUILD_AFTER), so the rounds below time the graph a kind in use runs
    per_token: dict[str, list[float]] = {p: [] for p in paths}
    cpu_per_token: dict[str, list[float]] = {p: [] for p in paths}
    tokens = {}
    for _ in range(args.rounds):
        for path, extra in paths.items():  # interleaved: load drifts hit both paths alike
            _, step, cpu, tokens[path] = timed(extra, python_wrapper=path == "fast_python_wrapper")
            per_token[path].append(step)
            cpu_per_token[path].append(cpu)
    result.update({f"{p}_s": statistics.median(v) for p, v in per_token.items()}, tokens=tokens)
    result.update({f"{p}_cpu_s": statistics.median(v) for p, v in cpu_per_token.items()})
    result["rounds_s"] = per_token
    result["load_after"] = os.getloadavg()[0]
    if not split or dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    if split:
        dist.destroy_process_group()


# --- the launcher ---------------------------------------------------------------------------------------


def _run(model: str, ranks: int, *, new: int, prompt: int, rounds: int, timeout: float, threads: int = 1,
         device: str = "cpu", balanced: bool = False, wrappers: bool = False) -> dict:
    """One job (`ranks` 0: the unsplit model in one process, with `threads` intra-op threads; `balanced`: the split
    with balance=True); its result."""
    args = ["--job", "--model", model, "--new", str(new), "--prompt", str(prompt), "--rounds", str(rounds)]
    args += ["--device", device]
    args += ["--split"] if ranks else ["--threads", str(threads)]
    args += ["--balanced"] if balanced else []
    args += ["--wrappers"] if wrappers and ranks else []
    return run_script(HERE, args, ranks=ranks, timeout=timeout, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})


def _table(model: str, unsplit: dict, split: dict[int, dict], new: int, threaded: dict[int, dict] | None = None,
           device: str = "cpu", balanced: dict[int, dict] | None = None) -> str:
    """The markdown table: the unsplit rows (one thread, and the fast path at each N of `threaded`), then the split."""
    eager, fast = unsplit["default_s"], unsplit["fast_s"]
    reference = unsplit["tokens"]["default"]
    how = "forced on CPU" if device == "cpu" else "CUDA graphs"
    lines = [
        f"{DESCRIPTIONS[model]}, batch 1, greedy, {new} new tokens, on {device}; per token (decode steps only), "
        "ratios against the unsplit fast path and unsplit eager; one intra-op thread per process unless said",
        "",
        "| run | per token | CPU per token | vs unsplit fast | vs unsplit eager | first call (compile) | tokens as unsplit |",
        "|---|---:|---:|---:|---:|---:|---|",
        f"| unsplit eager | {eager * 1e3:.2f} ms | {_cpu(unsplit, 'default')} | {eager / fast:.2f}x | 1.00x | | yes |",
        f"| unsplit fast (static + compile, {how}) | {fast * 1e3:.2f} ms | {_cpu(unsplit, 'fast')} | 1.00x | "
        f"{fast / eager:.2f}x | {unsplit['first_call_s']:.1f} s | {_same(unsplit['tokens']['fast'], reference)} |",
    ]
    for threads, r in sorted((threaded or {}).items()):
        s = r["fast_s"]
        lines.append(f"| unsplit fast, {threads} intra-op threads | {s * 1e3:.2f} ms | {_cpu(r, 'fast')} | {s / fast:.2f}x | "
                     f"{s / eager:.2f}x | {r['first_call_s']:.1f} s | {_same(r['tokens']['fast'], reference)} |")
    rows = [(ranks, r, "") for ranks, r in sorted(split.items())]
    rows += [(ranks, r, ", balanced") for ranks, r in sorted((balanced or {}).items())]
    labels = (("default", "split default"), ("fast", "split fast (static + compile)"),
              ("fast_python_wrapper", "split fast, Python wrapper"))
    for ranks, r, kind in rows:
        for path, label in labels:
            if f"{path}_s" not in r:
                continue
            first = f"{r['first_call_s']:.1f} s" if path == "fast" else ""
            s = r[f"{path}_s"]
            lines.append(f"| {label}, {ranks} ranks{kind} | {s * 1e3:.2f} ms | {_cpu(r, path)} | {s / fast:.2f}x | "
                         f"{s / eager:.2f}x | {first} | {_same(r['tokens'][path], reference)} |")
    return "\n".join(lines)


def _cpu(result: dict, path: str) -> str:
    cpu = result.get(f"{path}_cpu_s")
    return f"{cpu * 1e3:.2f} ms" if cpu is not None else ""


def _same(tokens: list, reference: list) -> str:
    return "yes" if tokens == reference else "NO"


def gpu_problem(device: str, ranks: list[int], gpus: int) -> str | None:
    """Why `--device`/`--ranks` cannot run with `gpus` visible GPUs (None: they can)."""
    return gpu_shortage(device, "--ranks", ranks, gpus,
                        "each rank needs a GPU of its own (NCCL refuses two ranks on one GPU)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2], help="rank counts of the split rows")
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--new", type=int, default=32, help="new tokens per generate()")
    parser.add_argument("--prompt", type=int, default=16, help="prompt length")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny Llama, 4 new tokens, 1 round: a check that it runs")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per job")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cpu (gloo ranks) or cuda (NCCL ranks)")
    parser.add_argument("--balance", action="store_true", help="also run each split with balance=True (a job of its own)")
    parser.add_argument("--wrappers", action="store_true",
                        help="also run each split fast path on inductor's Python wrapper (TENSORSHARD_CPP_WRAPPER=0), interleaved")
    parser.add_argument("--no-threaded", action="store_true", help="leave out the unsplit fast path at N intra-op threads")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--balanced", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--split", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        return _job(args)
    if args.quick:
        args.model, args.new, args.prompt, args.rounds = "tiny", 4, 6, 1
    if args.new < 3:
        parser.error(f"--new {args.new}: per-token times need at least 3 new tokens (2 decode steps)")
    if args.device == "cuda":
        import torch

        problem = gpu_problem(args.device, args.ranks, torch.cuda.device_count())
        if problem is not None:
            parser.error(problem)
    print(f"load average before: {os.getloadavg()}", flush=True)
    settings = dict(new=args.new, prompt=args.prompt, rounds=args.rounds, timeout=args.timeout, device=args.device)
    unsplit = _run(args.model, 0, **settings)
    threaded = {n: _run(args.model, 0, threads=n, **settings) for n in sorted(set(args.ranks))
                if n > 1 and args.device == "cpu" and not args.no_threaded}
    split = {n: _run(args.model, n, wrappers=args.wrappers, **settings) for n in args.ranks}
    balanced = {n: _run(args.model, n, balanced=True, **settings) for n in args.ranks} if args.balance else {}
    print(_table(args.model, unsplit, split, args.new, threaded, device=args.device, balanced=balanced))
    print(f"load average after: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"unsplit": unsplit, "unsplit_threads": threaded, "split": split, "balanced": balanced}, f, indent=1)


if __name__ == "__main__":
    main()
