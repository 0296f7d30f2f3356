"""The shards' captures of a kind of call as the capture store keeps them (engines/capture_store.py), and back.

A capture (stitched_step.py's `Capture`: a shard's dynamo graph, its inputs' sources, its output's fields) is kept
as values that outlive the process: the graph as bytes, each weight by its module's path in the shard. What is
this process's own is the number a collective names its comm by (comm/thread_ops.py `handle_of`): it is kept as
that comm's rank, and a capture read back calls comms of the split model's group made anew for it (held by the
capture: thread_ops holds comms weakly).

    payload = portable(model, captures)        # after the kind's step compiled
    captures = restored(model, payload)        # a later process, before the first call of that kind
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from ...comm import thread_ops
from ...comm.threads import ThreadComm
from .. import capture_store
from .stitched_step import Capture

_COLLECTIVES = (thread_ops.all_reduce, thread_ops.all_gather)


def portable(model: nn.Module, captures: Sequence[Capture]) -> list[dict]:
    """Each shard's capture as values (capture_store.py); TypeError or ValueError where one cannot be kept."""
    return [portable_capture(model, rank, capture) for rank, capture in enumerate(captures)]


def portable_capture(model: nn.Module, rank: int, capture: Capture) -> dict:
    """Shard `rank`'s capture as values (one item of `portable`'s list)."""
    ranks = {}
    for node in capture.graph.graph.nodes:
        if node.op == "call_function" and node.target in _COLLECTIVES:
            comm = thread_ops.comm_of(node.args[1])
            if comm.group is not model._group:
                raise ValueError("a collective of a group other than the split model's is not kept")
            ranks[node.args[1]] = comm.rank
    return {
        "graph": capture_store.portable_graph(capture.graph),
        "sources": capture_store.portable_sources(model.module_shards[rank], capture.sources),
        "comm_ranks": ranks, "fields": capture.fields, "output_type": capture.output_type,
    }


def restored(model: nn.Module, payload: list[dict]) -> list[Capture]:
    """The captures `portable` kept, on `model`'s shards and group; an error where they do not fit it. A collective
    keeps the comm it was traced with where that comm is alive and is the model's own at the same rank (captures
    traced by children forked from this process: forked_traces.py); otherwise it calls a comm made anew."""
    shards = model.module_shards
    if len(payload) != len(shards):
        raise ValueError(f"{len(payload)} captures kept for {len(shards)} shards")
    comms = [ThreadComm(model._group, rank) for rank in range(len(shards))]
    captures = []
    for rank, part in enumerate(payload):
        graph = capture_store.restored_graph(part["graph"])
        handles = {old: old if _own(model, old, r) else comms[r].handle for old, r in part["comm_ranks"].items()}
        if any(old != new for old, new in handles.items()):
            for node in graph.graph.nodes:
                if node.op == "call_function" and node.target in _COLLECTIVES:
                    node.args = (node.args[0], handles[node.args[1]], *node.args[2:])
            graph.recompile()
        capture = Capture(graph, capture_store.restored_sources(shards[rank], part["sources"]), part["fields"],
                          part["output_type"])
        capture.comms = comms  # (the comms its collectives name by handle: thread_ops holds them weakly)
        captures.append(capture)
    return captures


def _own(model: nn.Module, handle: int, rank: int) -> bool:
    """Whether `handle` names a live comm of `model`'s group at `rank`."""
    try:
        comm = thread_ops.comm_of(handle)
    except RuntimeError:  # (no comm of this process has that number)
        return False
    return comm.group is model._group and comm.rank == rank
