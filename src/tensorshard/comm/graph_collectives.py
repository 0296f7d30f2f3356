"""Collectives a CUDA graph can capture: the torchrun engine's compiled decode step on NCCL.

transformers compiles a static-cache decode step with `mode="reduce-overhead"` on CUDA (its default
`CompileConfig`): inductor captures the step in CUDA graphs, so a token is one replay, no Python. The engine's
traced collectives (comm/dist_ops.py) run a guarded collective in Python, which a replay would skip; they are
tagged `cudagraph_unsafe`, and inductor cuts the graph at each of them (62 cuts a token for SmolLM2-135M). Here,
gpt-fast's recipe instead: torch's functional collectives, which inductor lowers to NCCL calls on the rank's
stream, captured in the graph with the rest of the step:

    y = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group_name))

Every rank replays the same graph, so the NCCL calls meet in the same order on every rank, as in eager code.

When (DistComm, comm/dist.py, asks `applies` while dynamo traces): inside `capturing_decode()` (the torchrun
engine's wrapper of transformers' compiled decode step, engines/torchrun/decoding.py), for a tensor on a CUDA
device that needs no autograd, on a group whose backend is NCCL. Anywhere else the guarded operators stay.

What is different from the guarded collectives:
- counting: a replay runs no Python, so nothing can report each collective as it runs. While dynamo traces the
  step, each collective is noted once (`torch._dynamo.comptime`, which runs at trace time only) in the open
  `capturing_decode()` list; the caller keeps the notes of the call that compiled the step and reports them
  after every call of it (`report`), so `tp.count_collectives()` sees what the step runs. A frame that dynamo
  traces twice (it restarts its analysis at some graph breaks) would be noted twice: the default fullgraph
  trace of a decode step is not;
- a rank that fails: the others stop at NCCL's own timeout (the process group's), not at the engine's guard.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from .counter import record

try:  # dynamo's public hook for code run while it traces (torch 2.1 on)
    from torch._dynamo.comptime import comptime
except ImportError:  # pragma: no cover  (then `available()` is False: the guarded operators run)
    comptime = None

# The `capturing_decode()` block this process is in (one decode step at a time per process). Dynamo reads
# `_capturing` as it traces and guards on it (a graph traced inside runs only inside); `_notes` is read only at
# trace time, by `_note_traced`, so no guard depends on it.
_capturing = False
_notes: list[tuple[str, int, str]] | None = None


def available() -> bool:
    """Whether this torch has the functional collectives and dynamo's trace-time hook."""
    functional = getattr(torch.ops, "_c10d_functional", None)
    return comptime is not None and all(
        hasattr(functional, name) for name in ("all_reduce", "all_gather_into_tensor", "wait_tensor"))


@contextmanager
def capturing_decode() -> Iterator[list[tuple[str, int, str]]]:
    """Inside: DistComm traces its collectives as capturable ones (where `applies`); yields the list where the
    collectives traced inside are noted, as (kind, bytes, where)."""
    global _capturing, _notes
    notes: list[tuple[str, int, str]] = []
    previous = _capturing, _notes
    _capturing, _notes = available(), notes
    try:
        yield notes
    finally:
        _capturing, _notes = previous


# Where the functional collectives are taken. Their point is CUDA graphs (NCCL); they also run on gloo, which the
# CPU tests use to check this file's wiring and counting without a GPU (they set these two in their own process).
DEVICE_TYPES, BACKENDS = ("cuda",), ("nccl",)


def applies(x: torch.Tensor, backend: str) -> bool:
    """Trace this collective of `x`, on a group of `backend` ("nccl", "gloo"), as a capturable one?"""
    return (_capturing and x.device.type in DEVICE_TYPES and backend_of(backend, x.device.type) in BACKENDS
            and not (torch.is_grad_enabled() and x.requires_grad))


def backend_of(backend: str, device_type: str) -> str:
    """The backend a group uses for tensors of `device_type`: `backend` itself ("nccl"), or its entry for that device
    type in a group of several ("cpu:gloo,cuda:nccl", torch's default when init_process_group is given none)."""
    if ":" not in backend:
        return backend
    pairs = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    return pairs.get(device_type, "")


def all_reduce(x: torch.Tensor, group_name: str, where: str) -> torch.Tensor:
    """The sum of every rank's `x` (a new tensor), as NCCL calls a CUDA graph captures."""
    out = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", group_name))
    kind, nbytes = "all_reduce", x.numel() * x.element_size()  # (read by _note_traced, at trace time)
    comptime(_note_traced)
    return out


def all_gather(piece: torch.Tensor, group_name: str, world: int, where: str) -> torch.Tensor:
    """Every rank's `piece` (equal shapes) stacked on dim 0 in rank order: (world * piece.shape[0], ...)."""
    out = torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_gather_into_tensor(piece.contiguous(), world, group_name))
    kind, nbytes = "all_gather", world * piece.numel() * piece.element_size()  # (read by _note_traced)
    comptime(_note_traced)
    return out


def _note_traced(ctx) -> None:
    """At trace time (dynamo calls it; nothing runs when the graph does): note the collective of the calling
    frame (its locals `kind`, `nbytes`, `where`) in the open block."""
    if _notes is not None:
        _notes.append(tuple(ctx.get_local(name).as_python_constant() for name in ("kind", "nbytes", "where")))


def report(notes: list[tuple[str, int, str]]) -> None:
    """Report a compiled step's collectives to `tp.count_collectives()`: once per call of the step."""
    for kind, nbytes, where in notes:
        record(kind, nbytes, "forward", where)
