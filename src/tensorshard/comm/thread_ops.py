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

These take calls that build no autograd graph in the decode steps (compiled_steps.py, whose stitcher rewrites them
by their constants); a compiled call that does (training) runs comm/functions.py's autograd nodes over the raw
collectives as operators defined at the end of this file (comm/traced_collectives.py), which name the shard and the
call site by a tensor, and so do other compiled calls without gradients (evaluation, a model compiled per block).
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


def comm_of(handle: int) -> ThreadComm:
    """The collectives a compiled graph names by `handle` (`handle_of`): the graph's shard and group."""
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
    return _own(comm_of(comm).eager_all_reduce(x, where=where), x)


def _all_gather(x: torch.Tensor, comm: int, dim: int, layout: list[int], where: str) -> torch.Tensor:
    return _own(comm_of(comm).eager_all_gather(x, dim, partition_of(layout), where=where), x)


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


# --- the raw collectives as operators, for compiled calls that build an autograd graph ----------------------------
#
# A compiled training step (torch.compile of a split model: engines/inprocess/compiled_shards.py) traces comm/
# functions.py's autograd nodes themselves, over `TracedCollectives` (comm/traced_collectives.py), whose raw
# collectives are these operators: the forward and the backward of each node become graph nodes (aot_autograd
# splits them), each calling the shard's raw collective (`OneShard`) with the phase it runs in, so
# count_collectives() sees the eager path's collectives, forward and backward. The backward rules stay those of
# comm/functions.py; nothing here differentiates.
#
# These name the collective by a `site` tensor, not by constants: [handle of the shard's ThreadComm, number of the
# call site's name] (int64, on the CPU). A constant is something dynamo guards on, so with the handle and the name
# as constants every block of every shard traced a graph of its own (blocks x devices graphs for a model compiled
# per block, past dynamo's recompile limit of 8 the rest run eagerly); a tensor is a graph input, guarded on its
# shape and dtype only, so one graph serves every block and shard. A style's comm is bound to its module's name
# (`ThreadComm.at`), which holds that tensor; a comm bound to none makes it in the graph from constants (`site`).


class _DecodeSteps:
    """`compiling`: the decode steps of compiled_steps.py are running, whose graphs keep the no-gradient collectives
    above (`all_reduce`, `all_gather`: their handle and name constants are what stitched_step.py and
    parallel_step.py rewrite). Otherwise a bound comm's no-gradient collectives are these, named by their site
    tensor too. A global dynamo guards on: the same value for every block and shard."""

    compiling = False


decode_steps = _DecodeSteps()
_names: list[str] = []  # a call site's number -> its name (the `where` of the eager collectives)
_numbers: dict[str, int] = {}


def site_key(comm: int, where: str) -> torch.Tensor:
    """The `site` tensor of the collectives of the comm numbered `comm` at the call site `where`."""
    with _lock:
        number = _numbers.get(where)
        if number is None:
            number = _numbers[where] = len(_names)
            _names.append(where)
    return torch.tensor([comm, number], dtype=torch.int64)


def _site(site: torch.Tensor) -> tuple[ThreadComm, str]:
    comm, number = site.tolist()
    return comm_of(comm), _names[number]


class _Shard(Protocol):
    rank: int

    def reduce(self, xs, *, op: str, where: str, phase: str) -> list[torch.Tensor]: ...

    def gather(self, xs, dim: int, partition: Partition, *, op: str, where: str, phase: str) -> list[torch.Tensor]: ...

    def gather_into_one(self, xs, dim: int, partition: Partition, *, where: str) -> list[torch.Tensor]: ...

    def reduce_holders(self, xs, groups: list[list[int]], *, where: str) -> list[torch.Tensor]: ...


def _shard(site: torch.Tensor) -> tuple[_Shard, str]:
    comm, where = _site(site)
    return comm.shard, where  # type: ignore[attr-defined]  (ThreadComm.shard: its OneShard)


def _site_of(like: torch.Tensor, comm: int, where: str) -> torch.Tensor:
    return site_key(comm, where)


def _site_shape(like: torch.Tensor, comm: int, where: str) -> torch.Tensor:
    return torch.empty(2, dtype=torch.int64)


def _reduce(x: torch.Tensor, site: torch.Tensor, op: str, phase: str) -> torch.Tensor:
    shard, where = _shard(site)
    return _own(shard.reduce([x.contiguous()], op=op, where=where, phase=phase)[0], x)


def _gather(x: torch.Tensor, site: torch.Tensor, dim: int, layout: list[int], op: str, phase: str) -> torch.Tensor:
    shard, where = _shard(site)
    return _own(shard.gather([x.contiguous()], dim, partition_of(layout), op=op, where=where, phase=phase)[0], x)


def _assemble(x: torch.Tensor, site: torch.Tensor, dim: int, layout: list[int]) -> torch.Tensor:
    shard, where = _shard(site)
    return _own(shard.gather_into_one([x], dim, partition_of(layout), where=where)[0], x)


def flat_groups(groups: list[list[int]]) -> list[int]:
    """Groups of ranks (`tie`'s holders of a parameter) as one list of integers, which an operator takes:
    [count, then per group its length and ranks]. `groups_of` reads it back."""
    return [len(groups)] + [n for ranks in groups for n in (len(ranks), *ranks)]


def groups_of(flat: list[int]) -> list[list[int]]:
    """[count, then per group its length and ranks] -> the groups (`tie`'s holders of a parameter)."""
    groups, at = [], 1
    for _ in range(flat[0]):
        groups.append(list(flat[at + 1 : at + 1 + flat[at]]))
        at += 1 + flat[at]
    return groups


def _reduce_holders(x: torch.Tensor, site: torch.Tensor, groups: list[int]) -> torch.Tensor:
    shard, where = _shard(site)
    return _own(shard.reduce_holders([x.contiguous()], groups_of(groups), where=where)[0], x)


def _reduce_holders_shape(x: torch.Tensor, site: torch.Tensor, groups: list[int]) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_max(x: torch.Tensor, comm: int, where: str) -> torch.Tensor:
    return _own(comm_of(comm).all_reduce_max(x, where=where), x)  # type: ignore[attr-defined]


def _reduce_shape(x: torch.Tensor, site: torch.Tensor, op: str, phase: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _gather_shape(x: torch.Tensor, site: torch.Tensor, dim: int, layout: list[int], op: str, phase: str) -> torch.Tensor:
    return _all_gather_shape(x, 0, dim, layout, "")


def _assemble_shape(x: torch.Tensor, site: torch.Tensor, dim: int, layout: list[int]) -> torch.Tensor:
    return _all_gather_shape(x, 0, dim, layout, "")


def _all_reduce_max_shape(x: torch.Tensor, comm: int, where: str) -> torch.Tensor:
    return torch.empty_like(x)


_library.define("threads_site(Tensor like, int comm, str where) -> Tensor")
_library.define("threads_reduce(Tensor x, Tensor site, str op, str phase) -> Tensor", tags=_NOT_IN_CUDA_GRAPHS)
_library.define(
    "threads_gather(Tensor x, Tensor site, int dim, int[] layout, str op, str phase) -> Tensor", tags=_NOT_IN_CUDA_GRAPHS
)
_library.define("threads_assemble(Tensor x, Tensor site, int dim, int[] layout) -> Tensor", tags=_NOT_IN_CUDA_GRAPHS)
_library.define("threads_all_reduce_max(Tensor x, int comm, str where) -> Tensor", tags=_NOT_IN_CUDA_GRAPHS)
_library.define("threads_reduce_holders(Tensor x, Tensor site, int[] groups) -> Tensor", tags=_NOT_IN_CUDA_GRAPHS)
for _name, _impl, _fake in (
    ("threads_site", _site_of, _site_shape),
    ("threads_reduce", _reduce, _reduce_shape),
    ("threads_gather", _gather, _gather_shape),
    ("threads_assemble", _assemble, _assemble_shape),
    ("threads_all_reduce_max", _all_reduce_max, _all_reduce_max_shape),
    ("threads_reduce_holders", _reduce_holders, _reduce_holders_shape),
):
    _library.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"tensorshard::{_name}", _fake, lib=_library)

site = torch.ops.tensorshard.threads_site.default
reduce = torch.ops.tensorshard.threads_reduce.default
gather = torch.ops.tensorshard.threads_gather.default
assemble = torch.ops.tensorshard.threads_assemble.default
all_reduce_max = torch.ops.tensorshard.threads_all_reduce_max.default
reduce_holders = torch.ops.tensorshard.threads_reduce_holders.default
