"""A pool of gloo processes, spawned once per session, that runs test functions on every rank.

    pool = Pool(2)
    results = pool.run(task, arg1, arg2)      # task(arg1, arg2) on ranks 0 and 1; one result per rank

`task` must live at module level (spawn pickles it by name). Each worker initialises a gloo process group
through a `file://` rendezvous (no ports to clash), and sets the environment torchrun would (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so Lightning and `tensor_parallel(distributed=True)`
see an externally launched job. After a task every rank passes a barrier; a rank that fails (or a task
that times out) reports its traceback and the pool is torn down and restarted for the next task, since
the other ranks may be stuck in a collective.
"""

from __future__ import annotations

import os
import queue
import socket
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from support import ROOT

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child Python process (a torchrun job, a script): it imports tensorshard from this
    checkout's src/ and the tests' `support` package, and inherits none of this process's torchrun variables."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    paths = [str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.update(extra)
    return env


PG_TIMEOUT = 30  # seconds a rank may wait in a collective before gloo gives up


class RankFailure(AssertionError):
    """A task failed on at least one rank."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, init_file: str, port: int, tasks, results) -> None:
    import torch.distributed as dist

    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TENSORSHARD_TIMEOUT": str(PG_TIMEOUT),  # parallelize() sets the group's timeout: keep it short here
    })
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=PG_TIMEOUT)
    )
    environment = dict(os.environ)
    results.put((rank, True, "ready"))
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            value, ok = fn(*args), True
        except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
            value, ok = traceback.format_exc(), False
        os.environ.clear()
        os.environ.update(environment)  # Lightning edits the environment (e.g. drops WORLD_SIZE)
        if ok:
            try:
                dist.barrier()
            except BaseException:  # noqa: BLE001
                value, ok = traceback.format_exc(), False
        results.put((rank, ok, value))
    dist.destroy_process_group()


def world_mesh():
    """A 1-D tensor-parallel mesh over all ranks of the pool (for tasks)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


class Pool:
    """`world` spawned processes in one gloo group; started on first use, restarted after a failure."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.procs: list | None = None

    def start(self, timeout: float = 120) -> None:
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="tensorshard-pool-")
        init_file = os.path.join(self._dir.name, "rendezvous")
        port = free_port()
        self.tasks = [ctx.SimpleQueue() for _ in range(self.world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker, args=(r, self.world, init_file, port, self.tasks[r], self.results), daemon=True)
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()
        self._collect("start-up", timeout)

    def _collect(self, what: str, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        values: dict[int, object] = {}
        failures: dict[int, str] = {}
        grace = None  # after a failure: a short wait for the other ranks' reports
        while len(values) + len(failures) < self.world:
            now = time.monotonic()
            if now > deadline or (grace is not None and now > grace):
                break
            try:
                rank, ok, value = self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in values and r not in failures]
                for r in dead:
                    failures[r] = f"process exited with code {self.procs[r].exitcode}"
                if dead and grace is None:
                    grace = time.monotonic() + 3.0
                continue
            (values if ok else failures)[rank] = value
            if not ok and grace is None:
                grace = time.monotonic() + 3.0
        if failures or len(values) < self.world:
            self.stop()
            missing = [r for r in range(self.world) if r not in values and r not in failures]
            lines = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())]
            if missing:
                lines.append(f"ranks {missing} did not report within {timeout:g} s (stuck in a collective?)")
            raise RankFailure(f"{what} failed on {self.world} ranks:\n" + "\n".join(lines))
        return [values[r] for r in range(self.world)]

    def run(self, fn, *args, timeout: float = 90) -> list:
        """fn(*args) on every rank; the per-rank return values (must be picklable)."""
        if self.procs is None:
            self.start()
        for q in self.tasks:
            q.put((fn, args))
        return self._collect(getattr(fn, "__name__", "task"), timeout)

    def stop(self) -> None:
        if self.procs is None:
            return
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001
                    pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = None
        self._dir.cleanup()


_SHARED: dict[int, Pool] = {}


def shared_pool(world: int) -> Pool:
    """The session's pool of `world` ranks, one per size for every test folder (conftest fixtures stop it)."""
    if world not in _SHARED:
        _SHARED[world] = Pool(world)
    return _SHARED[world]
