"""Ranks in fresh processes, for fault tests that kill a rank, lose one, or leave a process group unusable.

    result = spawned.run(scenario, world=2)      # scenario(rank) on each rank, gloo over a file:// rendezvous
    result.exit_codes, result.exit_times         # per rank (time.monotonic(), comparable across processes)
    result.events[rank]                          # what scenario(rank) reported: spawned.report(key, value)
    spawned.wait_for_all("done", timeout=20)     # in a rank: stay until every rank got here (or the limit)

A scenario that raises is reported as event "raised" (type, message, notes, time) and then ends its process
with exit code 1, as an uncaught error ends a training script; a scenario that returns ends it with 0. Both skip
the interpreter's teardown, where a gloo group left out of step can make torch abort (SIGABRT), depending on
timing. The shared process pool of
tests/engines/torchrun cannot host these tests: a killed rank, or a group left out of step, ends it.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

_events = None  # in a spawned rank: the queue to the parent
_folder = None  # in a spawned rank: the run's temporary folder, which every rank sees


def report(key: str, value: Any) -> None:
    """From a rank: hand `value` to the test (picklable)."""
    _events.put((int(os.environ["RANK"]), key, value))


def wait_for_all(name: str, timeout: float) -> bool:
    """From a rank: mark `name` as reached, then wait until every rank has (True) or `timeout` s pass (False).
    Not a collective: it works with a process group left out of step, and a rank that died is waited for only
    until the limit."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    open(os.path.join(_folder, f"{name}.{rank}"), "w").close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(_folder, f"{name}.{r}")) for r in range(world)):
            return True
        time.sleep(0.05)
    return False


def describe(error: BaseException) -> dict:
    return {
        "type": type(error).__name__,
        "message": str(error),
        "notes": list(getattr(error, "__notes__", [])),
        "time": time.monotonic(),
    }


def _main(fn: Callable, rank: int, world: int, init_file: str, events) -> None:
    global _events, _folder
    import torch
    import torch.distributed as dist

    _events, _folder = events, os.path.dirname(init_file)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    try:
        fn(rank)
        os._exit(0)  # a script that ends, without the teardown (below)
    except BaseException as e:
        report("raised", describe(e))
        import traceback

        traceback.print_exc()  # as an uncaught error prints it; the report is already written (SimpleQueue)
        # Exit code 1, as an uncaught error ends a script, without the interpreter's teardown: with a gloo group
        # left out of step, torch's own destructors may abort (SIGABRT) at exit, depending on timing.
        os._exit(1)


@dataclass
class Result:
    exit_codes: list[int | None]
    exit_times: list[float | None]
    events: dict[int, dict[str, Any]] = field(default_factory=dict)


def run(fn: Callable[[int], Any], world: int = 2, timeout: float = 180) -> Result:
    """`fn(rank)` in `world` new processes; waits until all exit (or `timeout`, then kills them). The limit only
    stops a hang: a run returns when its processes end (tests/reliability's 3 ranks: ~30 s, but 62 s on 2 cores
    at load 19, where a 60 s limit killed them before they reported)."""
    ctx = mp.get_context("spawn")
    events = ctx.SimpleQueue()  # put() writes at once: a rank may kill itself right after reporting
    with tempfile.TemporaryDirectory(prefix="tensorshard-spawned-") as folder:
        init = os.path.join(folder, "rendezvous")
        procs = [ctx.Process(target=_main, args=(fn, r, world, init, events), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        exit_times: list[float | None] = [None] * world
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(t is None for t in exit_times):
            for r, p in enumerate(procs):
                if exit_times[r] is None and not p.is_alive():
                    exit_times[r] = time.monotonic()
            time.sleep(0.02)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    result = Result([p.exitcode for p in procs], exit_times, {r: {} for r in range(world)})
    while not events.empty():
        rank, key, value = events.get()
        result.events[rank][key] = value
    return result
