"""Time per collective between CPU ranks of one host: gloo's TCP path, tensorshard's shared memory, and the two
ways a compiled graph calls a collective.

    python benchmarks/collective_latency.py                       # 2 ranks; 64 B, 4 KiB and 2 MiB
    python benchmarks/collective_latency.py --ranks 2 4 8 --json benchmarks/results/collective_latency.json

Each rank is a process with one intra-op thread (as the torchrun engine runs them). Per transport, size and
kind (all-reduce, all-gather), the collectives run through tensorshard's own path (comm/transport.py, with
its guard: bounded waits and failure checks included), `--repeats` times after a warm-up, back to back. Reported
per collective: the median and the minimum wall time on rank 0, and the CPU time per rank (the process's,
all threads: gloo's own threads included), which the load of a shared machine blurs less than wall time.
The 2 MiB size is one (4, 128, 1024) fp32 activation, what the benchmark Llama all-reduces twice per block.

The transports, as rows:
    gloo               dist.all_reduce / all_gather through the guard (TENSORSHARD_SHM=0's path)
    shared memory      comm/shm.py through the guard: what eager code runs
    python op          torch.ops.tensorshard.all_reduce / all_gather (comm/dist_ops.py): what a compiled graph called
                       before the native collectives (a Python custom op around the shared-memory path)
    native op          torch.ops.tensorshard.native_all_reduce / native_all_gather (comm/native/, C++): what a
                       compiled decode step calls now, called here as inductor's Python wrapper calls it
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (64, 4096, 2 << 20)


def _rank(rank: int, world: int, init: str, args, results) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    from tensorshard.comm import transport
    from tensorshard.comm.dist_guard import guard_for

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from tensorshard.comm import dist_ops  # noqa: F401 - registers torch.ops.tensorshard.all_reduce / all_gather

    ranks = list(range(world))
    groups = {name: dist.new_group(ranks) for name in TRANSPORTS}
    natives = {}
    for name, group in groups.items():
        guard = guard_for(group, 120)
        if name != "gloo":
            transport.connect(guard, "cpu")
            if guard.shm is None:
                raise RuntimeError("the shared-memory transport could not be set up here")
        if name == "native op":
            natives[name] = transport.connect_native(guard)
            if natives[name] is None:
                raise RuntimeError("the native collectives could not be loaded here (see the log)")
    rows = []
    for nbytes in args.sizes:
        for kind in ("all_reduce", "all_gather"):
            for name, group in groups.items():
                t = torch.ones(max(1, nbytes // 4))
                out = t.new_empty(world * t.numel())
                call = _call(name, kind, t, out, group, natives.get(name), rank, world)
                repeats = args.repeats if nbytes < (1 << 20) else max(10, args.repeats // 10)
                for _ in range(5):
                    call()
                dist.barrier()
                walls = []
                cpu0 = time.process_time()
                for _ in range(repeats):
                    start = time.perf_counter()
                    call()
                    walls.append(time.perf_counter() - start)
                cpu = (time.process_time() - cpu0) / repeats
                rows.append({"transport": name, "kind": kind, "bytes": nbytes, "ranks": world, "repeats": repeats,
                             "median_ms": statistics.median(walls) * 1e3, "min_ms": min(walls) * 1e3, "cpu_ms": cpu * 1e3})
    cpus = [None] * world
    dist.all_gather_object(cpus, [r["cpu_ms"] for r in rows])
    if rank == 0:
        for i, row in enumerate(rows):
            row["cpu_ms_per_rank"] = [c[i] for c in cpus]
            row["cpu_ms"] = statistics.mean(row["cpu_ms_per_rank"])
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


TRANSPORTS = ("gloo", "shared memory", "python op", "native op")


def _call(name: str, kind: str, t: torch.Tensor, out: torch.Tensor, group, native, rank: int, world: int):
    from tensorshard.comm import transport

    if name == "native op":
        if kind == "all_reduce":
            op = torch.ops.tensorshard.native_all_reduce.default
            return lambda: op(t, native, rank, "bench")
        op = torch.ops.tensorshard.native_all_gather.default
        sizes = [t.shape[0]] * world
        return lambda: op(t, native, rank, 0, sizes, "bench")
    if name == "python op":
        if kind == "all_reduce":
            op = torch.ops.tensorshard.all_reduce.default
            return lambda: op(t, group.group_name, "bench")
        op = torch.ops.tensorshard.all_gather.default
        return lambda: op(t, group.group_name, world, rank, "bench")
    if kind == "all_reduce":
        return lambda: transport.all_reduce_(t, group, what="bench")
    return lambda: transport.all_gather_(out, t, group, what="bench")


def run(world: int, args) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="tensorshard-latency-") as folder:
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(folder, "rdv"), args, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        return results.get()


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def table(rows: list[dict]) -> str:
    """One line per (ranks, collective, size): each transport's median (min) wall time in us, then CPU us per rank."""
    names = [n for n in TRANSPORTS if any(r["transport"] == n for r in rows)]
    lines = ["| ranks | collective | size | " + " | ".join(f"{n}: median (min) us" for n in names)
             + " | CPU us per rank, " + " / ".join(names) + " |", "|---:|---|---:|" + "---:|" * (len(names) + 1)]
    by = {(r["ranks"], r["kind"], r["bytes"], r["transport"]): r for r in rows}
    for ranks, kind, nbytes in dict.fromkeys((r["ranks"], r["kind"], r["bytes"]) for r in rows):
        cells = [by[(ranks, kind, nbytes, n)] for n in names]
        lines.append(f"| {ranks} | {kind.replace('_', '-')} | {_size(nbytes)} | "
                     + " | ".join(f"{c['median_ms'] * 1e3:.1f} ({c['min_ms'] * 1e3:.1f})" for c in cells) + " | "
                     + " / ".join(f"{c['cpu_ms'] * 1e3:.1f}" for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="bytes per rank")
    parser.add_argument("--repeats", type=int, default=500, help="collectives timed per cell (a tenth for 1 MiB and more)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = [row for world in args.ranks for row in run(world, args)]
    load = os.getloadavg()
    print(f"{os.cpu_count()} cores, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}; torch {torch.__version__}")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": load, "cores": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
