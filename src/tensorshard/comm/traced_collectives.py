"""One in-process shard's raw collectives as operators of a compiled graph: what comm/functions.py's autograd
nodes run on while torch.compile traces a call that builds an autograd graph.

Traced eagerly, a shard's collective is a rendezvous of threads (comm/thread_collectives.py, `OneShard`) that
dynamo cannot follow: every one broke the graph. Here each raw collective is one operator of comm/thread_ops.py
that calls that same `OneShard` method when the graph runs, so dynamo traces the autograd nodes of comm/
functions.py themselves (their forward and backward, the backward rules written once there) and aot_autograd
puts each collective, forward or backward, into the forward or the backward graph:

    functions.AllReduce.apply(TracedCollectives(handle, rank, world, site), where, x)
        forward graph:  tensorshard::threads_reduce(x, site, "all_reduce", "forward")
        backward graph: (identity)

The operators name the shard's `ThreadComm` and the call site by a `site` tensor, an input of the graph rather than
a constant dynamo guards on (thread_ops.py), so the blocks of a model and the shards of a split model share their
graphs. A `TracedCollectives` bound to a site (a style's comm, `ThreadComm.at`) holds that tensor and runs every
collective under it, whatever `where` it is given; one bound to none makes the tensor inside the graph from its
handle and `where` (constants: a graph per shard and call site). A partition travels as integers.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..partition import Partition
from . import thread_ops
from .interface import Collectives


class TracedCollectives(Collectives):
    """Shard `rank`'s raw collectives as graph operators (one tensor per call: `ranks` is this shard alone), at the
    call site `site` (None: at the `where` each call names)."""

    def __init__(self, handle: int, rank: int, world_size: int, site: str | None = None) -> None:
        self.handle, self.rank, self.world_size = handle, rank, world_size
        self.ranks = (rank,)
        self.key = thread_ops.site_key(handle, site) if site is not None else None

    def _site(self, x: torch.Tensor, where: str) -> torch.Tensor:
        return self.key if self.key is not None else thread_ops.site(x, self.handle, where)

    def reduce(self, xs: Sequence[torch.Tensor], *, op: str, where: str, phase: str) -> list[torch.Tensor]:
        return [thread_ops.reduce(xs[0], self._site(xs[0], where), op, phase)]

    def gather(self, xs, dim: int, partition: Partition, *, op: str, where: str, phase: str) -> list[torch.Tensor]:
        return [thread_ops.gather(xs[0], self._site(xs[0], where), dim, thread_ops.layout_of(partition), op, phase)]

    def gather_into_one(self, xs, dim: int, partition: Partition, *, where: str) -> list[torch.Tensor]:
        return [thread_ops.assemble(xs[0], self._site(xs[0], where), dim, thread_ops.layout_of(partition))]

    def reduce_holders(self, xs, groups, *, where):
        return [thread_ops.reduce_holders(xs[0], self._site(xs[0], where), thread_ops.flat_groups(groups))]
