"""One in-process shard's raw collectives as operators of a compiled graph: what comm/functions.py's autograd
nodes run on while torch.compile traces a call that builds an autograd graph.

Traced eagerly, a shard's collective is a rendezvous of threads (comm/thread_collectives.py, `OneShard`) that
dynamo cannot follow: every one broke the graph. Here each raw collective is one operator of comm/thread_ops.py
that calls that same `OneShard` method when the graph runs, so dynamo traces the autograd nodes of comm/
functions.py themselves (their forward and backward, the backward rules written once there) and aot_autograd
puts each collective, forward or backward, into the forward or the backward graph:

    functions.AllReduce.apply(TracedCollectives(comm), where, x)
        forward graph:  tensorshard::threads_reduce(x, handle, "all_reduce", where, "forward")
        backward graph: (identity)

The operators take the shard's `ThreadComm` by its number (`handle`, thread_ops.py) and a partition as integers.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..partition import Partition
from . import thread_ops
from .interface import Collectives


class TracedCollectives(Collectives):
    """Shard `rank`'s raw collectives as graph operators (one tensor per call: `ranks` is this shard alone)."""

    def __init__(self, handle: int, rank: int, world_size: int) -> None:
        self.handle, self.rank, self.world_size = handle, rank, world_size
        self.ranks = (rank,)

    def reduce(self, xs: Sequence[torch.Tensor], *, op: str, where: str, phase: str) -> list[torch.Tensor]:
        return [thread_ops.reduce(xs[0], self.handle, op, where, phase)]

    def gather(self, xs, dim: int, partition: Partition, *, op: str, where: str, phase: str) -> list[torch.Tensor]:
        return [thread_ops.gather(xs[0], self.handle, dim, thread_ops.layout_of(partition), op, where, phase)]

    def gather_into_one(self, xs, dim: int, partition: Partition, *, where: str) -> list[torch.Tensor]:
        return [thread_ops.assemble(xs[0], self.handle, dim, thread_ops.layout_of(partition), where)]

    def reduce_holders(self, xs, groups, *, where):
        flat = [len(groups)] + [n for ranks in groups for n in (len(ranks), *ranks)]
        return [thread_ops.reduce_holders(xs[0], self.handle, flat, where)]
