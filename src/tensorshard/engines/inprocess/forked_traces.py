"""The first fast call of a kind, every shard's step traced at the same time: one forked child process per shard.

    if forked_traces.applies(model):
        traced = forked_traces.trace(model, per_rank, context, calls)   # TraceFailed: trace in this process instead
        captures = kept_captures.restored(model, traced.payload)          # then as from captures kept on disk

Dynamo runs Python and holds the GIL, so in one process the shards' traces run one after the other: on
SmolLM2-135M's shape at 2 devices two traces of ~71,000 bytecodes each, against one of ~52,000 for the unsplit
model, made the split model's first fast call twice as long as the unsplit one's. Here a child forked from the calling
thread has the split model as it is (its pages shared with this process until written) and traces one shard's call,
each child on its own core:

1. under `torch.compile(fullgraph=True)` with a backend that keeps dynamo's graph and runs nothing: the graph's
   outputs are empty tensors of their shapes (what the call returns is only matched against them, by identity, to
   learn which output is which field: graph_inputs.py `output_fields`). A collective in the graph never runs, so a
   child never waits for a shard that is not there;
2. a second time with the same arguments: a second graph means the step depends on Python state the first call
   changed (a sliding-window cache layer's count), which one fixed graph cannot follow;
3. writes its capture as the capture store keeps it (kept_captures.py `portable_capture`) and exits (`os._exit`:
   nothing of this process's runs at its exit).

This process builds the kind's step from the children's captures the way it builds one from captures an earlier
process kept (stitched_decode.py), and runs the call with it. Its own state is untouched by the traces: what dynamo
replays of a traced call's Python side effects happens in the children.

Only where a fork is safe and pays: Linux, two shards or more, CUDA not initialised in this process, the switch
``TENSORSHARD_FORKED_TRACE`` on (the default). At most as many children run at once as this process may use cores.
A child that fails (a graph break, an input or output that cannot be located), stops using CPU for `STALL` seconds
(a lock another thread of this process held at the fork), or is still tracing after `LIMIT` seconds is killed:
`TraceFailed` says why, and the kind is traced in this process as before.
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import warnings
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import torch
from torch import fx, nn
from torch._guards import TracingContext

from ...switches import switched_on
from .. import capture_store
from ..graph_inputs import locate_inputs, output_fields
from ..own_code import own_function
from .kept_captures import portable_capture
from .stitched_step import Capture

ENV = "TENSORSHARD_FORKED_TRACE"
STALL = 15.0  # seconds without CPU time after which a child is taken for deadlocked
LIMIT = 1800.0  # seconds a child may trace at most
_POLL = 0.02


class TraceFailed(RuntimeError):
    """A child could not trace its shard (the reason is the message): trace the kind in this process."""


@dataclass
class Traced:
    """What the children sent back: `payload` (each shard's capture as kept_captures.restored takes it), the source
    files dynamo traced (`files`, for the capture store's entry) and each child's (start, end) on the monotonic
    clock (`spans`)."""

    payload: list[dict]
    files: set[str] = field(default_factory=set)
    spans: list[tuple[float, float]] = field(default_factory=list)


def applies(model: nn.Module) -> bool:
    """Trace this split model's shards in forked children? (See the module doc.)"""
    return (sys.platform.startswith("linux") and hasattr(os, "fork") and len(model.module_shards) > 1
            and not torch.cuda.is_initialized() and switched_on(ENV))


def trace(model: nn.Module, per_rank: Sequence[dict], context: Callable[[], AbstractContextManager],
          options: dict[str, Any], meanwhile: Callable[[], None] | None = None) -> Traced:
    """Each shard's call with keyword arguments `per_rank[rank]` (its own, as the shard takes them) traced in a
    child of its own, inside `context()`, with torch.compile `options` (``dynamic``); TraceFailed where one fails.
    `meanwhile`: work for this process while the children trace (once they all started)."""
    world = len(model.module_shards)
    folder = Path(tempfile.mkdtemp(prefix="tensorshard-traces-"))
    children: dict[int, int] = {}  # pid -> rank
    try:
        waiting = list(range(world))
        cores = max(1, len(os.sched_getaffinity(0)))
        watch = _Watch()
        while waiting or children:
            while waiting and len(children) < cores:
                rank = waiting.pop(0)
                pid = _fork()
                if pid == 0:
                    _child(model, rank, per_rank[rank], context, options, folder)
                children[pid] = rank
                watch.started(pid)
            if meanwhile is not None and not waiting:
                meanwhile()
                meanwhile = None
            done = watch.poll(children)
            for pid in done:
                rank = children.pop(pid)
                if not (folder / f"{rank}.pkl").exists():
                    why = (folder / f"{rank}.err").read_text() if (folder / f"{rank}.err").exists() else "it exited early"
                    raise TraceFailed(f"shard {rank}'s trace failed: {why}")
        results = [pickle.loads((folder / f"{rank}.pkl").read_bytes()) for rank in range(world)]
    finally:
        for pid in children:  # (a failure or a stall: the others are not needed any more)
            _kill(pid)
        shutil.rmtree(folder, ignore_errors=True)
    return Traced([r["part"] for r in results], set().union(*(r["files"] for r in results)),
                  [r["span"] for r in results])


# --- in this process ------------------------------------------------------------------------------------------


def _fork() -> int:
    with warnings.catch_warnings():  # (Python 3.12 warns at a fork of a process with threads; a child here runs only
        # the forking thread's work, and one that waits for another thread's lock is stopped: `_Watch`)
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


class _Watch:
    """The children's exits, and the ones that stall (no CPU time for STALL seconds) or outlive LIMIT."""

    def __init__(self) -> None:
        self.cpu: dict[int, tuple[int, float]] = {}  # pid -> (CPU ticks, when they last grew)
        self.begun: dict[int, float] = {}

    def started(self, pid: int) -> None:
        now = time.monotonic()
        self.cpu[pid], self.begun[pid] = (-1, now), now

    def poll(self, children: dict[int, int]) -> list[int]:
        """The children that exited since the last poll (waiting a little when none has); TraceFailed for one that
        stalled or ran too long."""
        time.sleep(_POLL)
        done = []
        now = time.monotonic()
        for pid, rank in children.items():
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                done.append(pid)
                continue
            ticks = _cpu_ticks(pid)
            if ticks != self.cpu[pid][0]:
                self.cpu[pid] = (ticks, now)
            elif now - self.cpu[pid][1] > STALL:
                raise TraceFailed(f"shard {rank}'s tracing process used no CPU for {STALL:.0f} s (a lock another "
                                  "thread held when it was forked, most likely)")
            if now - self.begun[pid] > LIMIT:
                raise TraceFailed(f"shard {rank}'s tracing process was still tracing after {LIMIT:.0f} s")
        return done


def _cpu_ticks(pid: int) -> int:
    """The user + system CPU time process `pid` has used, in clock ticks (/proc; -1 where it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return -1


# --- in a child -----------------------------------------------------------------------------------------------


def _child(model: nn.Module, rank: int, kwargs: dict, context: Callable[[], AbstractContextManager],
           options: dict[str, Any], folder: Path) -> NoReturn:
    """Trace shard `rank`'s call (see the module doc), write what `trace` reads, and leave the process."""
    status = 1
    started = time.monotonic()
    try:
        gc.disable()  # (a collection would walk, and so copy, every page of objects this process shares)
        torch.set_num_threads(1)  # (no OpenMP team: one forked from a process that had one may never start)
        shard = model.module_shards[rank]
        backend = _KeepOnly()
        traced = torch.compile(own_function(shard, f"shard{rank}_forked_trace"), backend=backend, fullgraph=True,
                               dynamic=options.get("dynamic"))
        with context():
            out = traced(**kwargs)
            traced(**kwargs)
        if len(backend.kept) != 1:
            raise TraceFailed("dynamo compiled again at a second call with the same arguments: the step depends on "
                              "Python state that changes per call")
        gm, inputs, files = backend.kept[0]
        names = [node.name for node in gm.graph.find_nodes(op="placeholder")]
        capture = Capture(gm, locate_inputs(shard, kwargs, inputs, names), output_fields(out, backend.outputs[0], kwargs),
                          type(out))
        _write(folder / f"{rank}.pkl", {"part": portable_capture(model, rank, capture), "files": files,
                                        "span": (started, time.monotonic())})
        status = 0
    except BaseException as error:  # (everything: this process must reach os._exit)
        try:
            _write(folder / f"{rank}.err", f"{type(error).__name__}: {error}", text=True)
        except BaseException:
            pass
    finally:
        os._exit(status)


def _write(path: Path, value: Any, *, text: bool = False) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(value.encode() if text else pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    os.replace(tmp, path)


class _KeepOnly:
    """A backend that keeps dynamo's graph (with the real tensors it reads, and the source files traced) and runs
    nothing: every call returns new empty tensors of the graph's output shapes (one per output node)."""

    def __init__(self) -> None:
        self.kept: list[tuple[fx.GraphModule, list, set[str]]] = []
        self.outputs: list[Any] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        self.kept.append((gm, list(example_inputs), capture_store.traced_files(TracingContext.get_traced_code() or ())))
        results = gm.graph.output_node().args[0]

        def run(*inputs: Any) -> Any:
            made: dict[fx.Node, torch.Tensor] = {}
            outs = type(results)(_empty_like(node, made) for node in results)
            self.outputs.append(outs)
            return outs

        return run


def _empty_like(node: Any, made: dict) -> Any:
    if not isinstance(node, fx.Node):
        return node
    if node not in made:
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            raise TraceFailed(f"graph output {node.name} is a {type(value).__name__}, not a tensor")
        made[node] = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    return made[node]
