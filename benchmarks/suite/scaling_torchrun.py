"""The torchrun engine at 1..8 ranks, measured the way a plain user script runs it, with the accounting that
explains its speed-up: for benchmarks/scaling.py, or on its own.

    from suite.scaling_torchrun import SPECS, measure, sweep
    result = measure(SPECS["llama"], world=4)                 # one torchrun job of 4 ranks, every kind
    rows = sweep(SPECS["small"], worlds=[1, 2, 4, 8], kinds=["decode"], unsplit=True)

    python benchmarks/suite/scaling_torchrun.py --model small --worlds 1 2 4 8 --kinds decode
    python benchmarks/suite/scaling_torchrun.py --quick          # tiny models, 1 and 2 ranks: a check that it runs

The user script, in every rank: `torch.set_num_threads(1)`, `dist.init_process_group("gloo")`,
`tp.parallelize(model, init_device_mesh("cpu", (world,)))` with the preset plan, `torch.optim.AdamW(
model.parameters())`. Kinds:

- forward: the training batch, no gradients (the logits gathered, as a forward returns them)
- train: `model(input_ids=batch, labels=batch).loss.backward()`, `optimizer.step()`, `zero_grad()`
- decode: `generate(prompt, max_new_tokens=n, do_sample=False)`, reported per new token

After one warm-up call of each, `rounds` rounds call each kind once (interleaved), each call between two
barriers. Per kind (the median over rounds): the wall time of the slowest rank (`wall_s`); CPU seconds of all
ranks together (`cpu_s`: each process's CPU time, all its threads, gloo's included: the work, which the
load of a shared machine blurs much less than wall time; `cpu_s` at N ranks / at 1 rank is the work that
splitting adds); per rank the time inside the tensor-parallel group's collectives (`collective_s`: waiting
for the other ranks included) and the process CPU time; the collectives and their bytes per call
(`tp.count_collectives()`); and, from one more call under torch.profiler, per rank the CPU time of the main
thread outside ATen operators (`python_s`: Python, module calls, autograd and dispatch; an estimate, inflated
by the profiler's own cost per operator). `unsplit=True` measures the model without tensorshard in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

KINDS = ("forward", "train", "decode")
HERE = Path(__file__).resolve()
REPO = HERE.parents[2]


@dataclass(kw_only=True)
class ModelSpec:
    """A Llama (transformers' LlamaConfig, random weights, seed 0) and its inputs."""

    name: str
    config: dict
    batch: int = 4  # forward and train: (batch, seq) tokens
    seq: int = 128
    prompt: int = 16  # decode: one prompt of this many tokens, then `new_tokens` greedy tokens
    new_tokens: int = 32


def _llama(vocab: int, hidden: int, mlp: int, layers: int, heads: int, kv_heads: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
                tie_word_embeddings=False)


SPECS = {
    # BENCHMARKS.md's ~104M Llama (its sizes divide by 8)
    "llama": ModelSpec(name="llama", config=_llama(16384, 1024, 2816, 6, 16, 8), batch=4, seq=128, new_tokens=48),
    # dispatch-bound decoding: a step is mostly Python and kernel launches (issue 23)
    "small": ModelSpec(name="small", config=_llama(2048, 256, 704, 8, 8, 4), batch=1, seq=16, new_tokens=32),
    # --quick
    "tiny": ModelSpec(name="tiny", config=_llama(256, 64, 128, 2, 4, 2), batch=2, seq=16, prompt=6, new_tokens=8),
}


# --- the launcher (any process) -------------------------------------------------------------------------------


def measure(spec: ModelSpec, world: int, *, kinds=KINDS, rounds: int = 5, unsplit: bool = False,
            python: str = sys.executable, timeout: float = 1800) -> dict:
    """One job: `world` ranks under torchrun (or the unsplit model in one process); its result (see the module
    docstring). Raises RuntimeError with the job's last output lines when it fails."""
    if unsplit and world != 1:
        raise ValueError(f"the unsplit model runs in one process; got world={world}")
    args = ["--job", "--spec", json.dumps(asdict(spec)), "--kinds", *kinds, "--rounds", str(rounds)]
    args += ["--unsplit"] if unsplit else []
    return run_script(HERE, args, ranks=0 if unsplit else world, timeout=timeout, python=python)


def run_script(script: Path, args: list[str], *, ranks: int, timeout: float, python: str = sys.executable,
               env: dict[str, str] | None = None) -> dict:
    """`script args --out FILE` in one process (`ranks` 0) or under torchrun with `ranks` processes, one intra-op
    thread each; the JSON it wrote to FILE. Raises RuntimeError with the job's last output lines when it fails."""
    with tempfile.TemporaryDirectory(prefix="tensorshard-bench-") as folder:
        out = os.path.join(folder, "result.json")
        job = [str(script), *args, "--out", out]
        cmd = [python, *job] if not ranks else [
            python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *job]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", **(env or {}),
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p)}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
            raise RuntimeError(f"{' '.join(cmd[:6])} ... failed (exit status {proc.returncode}):\n{tail}")
        with open(out) as f:
            return json.load(f)


def sweep(spec: ModelSpec, worlds=(1, 2, 4, 8), *, kinds=KINDS, rounds: int = 5, unsplit: bool = False, **kwargs) -> list[dict]:
    """`measure` at each world size (and the unsplit model first, with `unsplit`), each result with its ratios
    against 1 rank: `speedup` (wall at 1 rank / wall here) and `work` (CPU seconds here / at 1 rank), per kind."""
    results = [measure(spec, 1, kinds=kinds, rounds=rounds, unsplit=True, **kwargs)] if unsplit else []
    results += [measure(spec, w, kinds=kinds, rounds=rounds, **kwargs) for w in worlds]
    one = next((r for r in results if r["world"] == 1 and not r["unsplit"]), None)
    plain = results[0] if unsplit else None
    for r in results:
        for kind, k in r["kinds"].items():
            if one is not None:
                k["speedup"] = one["kinds"][kind]["wall_s"] / k["wall_s"]
                k["work"] = k["cpu_s"] / one["kinds"][kind]["cpu_s"]
            if plain is not None:
                k["vs_unsplit"] = k["wall_s"] / plain["kinds"][kind]["wall_s"]
    return results


def table(results: list[dict]) -> str:
    """A markdown table of `sweep`'s results."""
    lines = ["| model | ranks | kind | wall | speed-up | CPU work vs 1 rank | at collectives per rank | Python per rank | collectives per call |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        for kind, k in r["kinds"].items():
            unit = "ms/token" if kind == "decode" else "ms"
            ranks = "unsplit" if r["unsplit"] else str(r["world"])
            coll = ", ".join(f"{n} {name.replace('_', '-')}" for name, n in sorted(k["collectives"].items())) or "none"
            python = "/".join(f"{1e3 * p:.0f}" for p in k["python_s"]) if None not in k.get("python_s", [None]) else "-"
            lines.append(
                f"| {r['model']} | {ranks} | {kind} | {1e3 * k['wall_s']:.1f} {unit} | {k.get('speedup', float('nan')):.2f}x | "
                f"{k.get('work', float('nan')):.2f}x | {'/'.join(f'{1e3 * c:.0f}' for c in k['collective_s'])} ms | {python} ms | "
                f"{coll} ({k['bytes'] / 2**20:.2f} MiB) |")
    return "\n".join(lines)


# --- the job (every rank) ---------------------------------------------------------------------------------------


def _job(args) -> None:
    import torch

    torch.set_num_threads(1)
    spec = ModelSpec(**json.loads(args.spec))
    distributed = not args.unsplit
    if distributed:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world, rank = 1, 0
    import tensorshard as tp
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**spec.config))
    guard = None
    if distributed:
        model = tp.parallelize(model, init_device_mesh("cpu", (world,)))
        guard = model.tensorshard.comm.guard
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5) if "train" in args.kinds else None
    g = torch.Generator().manual_seed(0)
    vocab = spec.config["vocab_size"]
    batch = torch.randint(0, vocab, (spec.batch, spec.seq), generator=g)
    prompt = torch.randint(3, vocab, (1, spec.prompt), generator=g)
    tokens = {}

    def forward():
        with torch.no_grad():
            model(input_ids=batch)

    def train():
        model.train()
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()

    def decode():
        with torch.no_grad():
            ids = model.generate(prompt, max_new_tokens=spec.new_tokens, min_new_tokens=spec.new_tokens, do_sample=False)
        tokens["decode"] = ids[0, prompt.shape[1]:].tolist()

    model.eval()
    calls = {"forward": forward, "train": train, "decode": decode}
    per_call = {"decode": spec.new_tokens}
    barrier = (lambda: dist.barrier()) if distributed else (lambda: None)
    samples: dict[str, list[tuple[float, float, float]]] = {k: [] for k in args.kinds}
    counted: dict[str, dict] = {}
    for kind in args.kinds:  # warm-up; the collectives of one call
        barrier()
        with tp.count_collectives() as c:
            calls[kind]()
        counted[kind] = {"counts": c.counts, "bytes": c.bytes}
    for _ in range(args.rounds):
        for kind in args.kinds:
            barrier()
            waited = guard.seconds if guard is not None else 0.0
            start, cpu = time.perf_counter(), time.process_time()
            calls[kind]()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            samples[kind].append((wall, cpu, (guard.seconds - waited) if guard is not None else 0.0))
    python = {kind: _python_time(calls[kind], barrier, guard) for kind in args.kinds}  # after the timed rounds
    mine = {"samples": samples, "python": python, "tokens": tokens.get("decode")}
    if distributed:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    if rank == 0:
        result = {"model": spec.name, "world": world, "unsplit": args.unsplit, "rounds": args.rounds,
                  "load_average": os.getloadavg(), "cores": os.cpu_count(), "torch": torch.__version__,
                  "tokens": mine["tokens"], "kinds": {}}
        for kind in args.kinds:
            n = per_call.get(kind, 1)
            rounds = range(args.rounds)
            walls = [max(r["samples"][kind][i][0] for r in everyone) / n for i in rounds]
            cpus = [sum(r["samples"][kind][i][1] for r in everyone) / n for i in rounds]
            result["kinds"][kind] = {
                "unit": "token" if kind == "decode" else "call",
                "wall_s": statistics.median(walls), "wall_all": walls,
                "cpu_s": statistics.median(cpus), "cpu_all": cpus,
                "cpu_per_rank_s": [statistics.median(s[1] for s in r["samples"][kind]) / n for r in everyone],
                "collective_s": [statistics.median(s[2] for s in r["samples"][kind]) / n for r in everyone],
                "python_s": [r["python"][kind] / n if r["python"][kind] is not None else None for r in everyone],
                "collectives": {k: v / n for k, v in counted[kind]["counts"].items()},
                "bytes": counted[kind]["bytes"] / n,
            }
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.out)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def _python_time(call, barrier, guard) -> float | None:
    """CPU seconds of one call's main thread outside ATen operators, from torch.profiler: Python, module calls,
    autograd's and the dispatcher's own work. The profiler gives wall times; the share of the thread's busy
    wall time (the call's, less its waits at collectives) spent outside the outermost operators (an operator
    called by another counts once), times the thread's CPU time: on a loaded machine descheduling stretches
    both parts alike."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    barrier()
    cpu, waited = time.thread_time(), guard.seconds if guard is not None else 0.0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("scaling: the call"):
            call()
    cpu, waited = time.thread_time() - cpu, (guard.seconds - waited) if guard is not None else 0.0
    events = prof.events()
    marker = next((e for e in events if e.name == "scaling: the call"), None)
    if marker is None:
        return None

    def outermost_op(e) -> bool:
        if not e.name.startswith("aten::") or e.thread != marker.thread:
            return False
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    busy = marker.time_range.elapsed_us() / 1e6 - waited
    inside = sum(e.time_range.elapsed_us() for e in events if outermost_op(e)) / 1e6
    return cpu * max(0.0, 1 - inside / busy) if busy > 0 else None


# --- command line ------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SPECS), default="llama")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--unsplit", action="store_true", help="also the model without tensorshard, in one process")
    parser.add_argument("--quick", action="store_true", help="the tiny model at 1 and 2 ranks, 2 rounds")
    parser.add_argument("--json", help="write the results here")
    # the job itself, started by measure() in every rank
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        _job(args)
        return
    spec = SPECS["tiny" if args.quick else args.model]
    worlds, rounds = ([1, 2], 2) if args.quick else (args.worlds, args.rounds)
    results = sweep(spec, worlds, kinds=args.kinds, rounds=rounds, unsplit=args.unsplit or args.quick)
    load = os.getloadavg()
    print(f"{os.cpu_count()} cores, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
