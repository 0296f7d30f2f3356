"""The in-process collectives as operators that `torch.compile` keeps inside its graph.

A shard's decode step is compiled once (engines/inprocess/compiled_steps.py) and replayed per token. Traced as
Python, a collective of the in-process engine is a rendezvous of threads that dynamo cannot follow: every call site
would break the graph in two (a resume function with its own guards per site: 18 per token for an 8-block Llama),
which costs more than the compiled code saves. Here each collective a decode step needs is one opaque operator,

    tensorshard::threads_all_reduce(x, comm, where)              -> the sum over the shards (a new tensor)
    tensorshard::threads_all_gather(x, comm, dim, layout, where) -> the whole tensor along `dim`

whose implementation is the eager collective of the shard's `ThreadComm` (the same rendezvous, the same rank-ordered
sums, the same counters), so a compiled graph holds the whole forward and calls back into Python only at the
collectives. `comm` is a small integer naming the shard's `ThreadComm` (`handle`); `layout` is the `Partition`
flattened to integers, which a traced graph can carry as a constant.

Only calls that build no autograd graph take this route (decoding, evaluation): a compiled training step keeps the
collectives' autograd functions, each a graph break, as before.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Protocol

import torch

from ..partition import Partition


class ThreadComm(Protocol):
    """What these operators need of a shard's `ThreadComm` (comm/threads.py, which imports this module)."""

    def eager_all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor: ...

    def eager_all_gather(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor: ...


_comms: "weakref.WeakValueDictionary[int, ThreadComm]" = weakref.WeakValueDictionary()
_next = itertools.count(1)
_lock = threading.Lock()


def handle_of(comm: ThreadComm) -> int:
    """A number naming `comm` in compiled graphs (kept only while the comm lives)."""
    with _lock:
        handle = next(_next)
        _comms[handle] = comm
    return handle


def _comm(handle: int) -> ThreadComm:
    comm = _comms.get(handle)
    if comm is None:
        raise RuntimeError(
            f"a compiled graph called a collective of a split model that no longer exists (handle {handle}); "
            "compile the split model's step again (a new split model compiles its own)"
        )
    return comm


def layout_of(partition: Partition) -> list[int]:
    """A `Partition` as integers: [size, ranks, then per rank its range count and (start, stop) pairs]."""
    out = [partition.size, len(partition.ranges)]
    for ranges in partition.ranges:
        out.append(len(ranges))
        for start, stop in ranges:
            out.extend((start, stop))
    return out


def partition_of(layout: list[int]) -> Partition:
    """The inverse of `layout_of`."""
    size, ranks, at = layout[0], layout[1], 2
    ranges = []
    for _ in range(ranks):
        count = layout[at]
        pairs = layout[at + 1 : at + 1 + 2 * count]
        ranges.append(tuple((pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2)))
        at += 1 + 2 * count
    return Partition(size, tuple(ranges))


def _own(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """An operator's output must not share memory with its input."""
    return y.clone() if y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else y


def _all_reduce(x: torch.Tensor, comm: int, where: str) -> torch.Tensor:
    return _own(_comm(comm).eager_all_reduce(x, where=where), x)


def _all_gather(x: torch.Tensor, comm: int, dim: int, layout: list[int], where: str) -> torch.Tensor:
    return _own(_comm(comm).eager_all_gather(x, dim, partition_of(layout), where=where), x)


def _all_reduce_shape(x: torch.Tensor, comm: int, where: str) -> torch.Tensor:
    return torch.empty_like(x)


def _all_gather_shape(x: torch.Tensor, comm: int, dim: int, layout: list[int], where: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = layout[0]
    return x.new_empty(shape)


# Defined with torch.library's low-level API: the dispatcher calls the Python function directly (a few microseconds
# per call; a collective runs ~20 times per token), where `torch.library.custom_op` adds its autograd and
# dynamo-disabling layers to every call.
_library = torch.library.Library("tensorshard", "DEF")
# (the torchrun engine's collectives are operators of the same namespace: comm/dist_ops.py). Kept out of CUDA graphs:
# they call back into Python, which a replayed graph would skip.
_NOT_IN_CUDA_GRAPHS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)
_library = torch.library.Library("tensorshard", "FRAGMENT")
_library.define("threads_all_reduce(Tensor x, int comm, str where) -> Tensor", tags=_NOT_IN_CUDA_GRAPHS)
_library.define("threads_all_gather(Tensor x, int comm, int dim, int[] layout, str where) -> Tensor", tags=_NOT_IN_CUDA_GRAPHS)
_library.impl("threads_all_reduce", _all_reduce, "CompositeExplicitAutograd")
_library.impl("threads_all_gather", _all_gather, "CompositeExplicitAutograd")
torch.library.register_fake("tensorshard::threads_all_reduce", _all_reduce_shape, lib=_library)
torch.library.register_fake("tensorshard::threads_all_gather", _all_gather_shape, lib=_library)

all_reduce = torch.ops.tensorshard.threads_all_reduce.default
all_gather = torch.ops.tensorshard.threads_all_gather.default
