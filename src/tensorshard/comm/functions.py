"""The collectives as autograd nodes, written once for every engine and placement.

Each node follows the SPMD convention of comm/interface.py and runs its communication through the raw collectives
(`Collectives`) it is given: a torchrun process's (comm/process_group.py), an in-process shard's that meets the
other shards at the rendezvous (comm/thread_collectives.py, `OneShard`), or those of in-process shards sharing one
accelerator, where one node holds every shard's tensor (`AllShards`). A node has one input and one output per rank
of `c.ranks`, in that order:

    node              forward                         backward
    AllReduce         reduce                          identity (dL/dy is replicated)
    CopyToParallel    identity                        reduce
    AllGather         gather                          take own slice
    Assemble          gather into one shared whole    take own slice
    Split             take own slice                  gather
    Tie               identity                        reduce over the holders of a parameter
    ReduceScatter     reduce-scatter (sequence)       all-gather (sequence)
    GatherSequence    all-gather (sequence)           reduce-scatter once column layers claimed it, else own slice
    SumGrads          identity (many parameters)      reduce each one's gradient (in-process partial_grads)
    GatherRows        gather many along dim 0         take own rows (in-process ZeRO-3)

The backward rules of all-reduce, all-gather and copy-to-parallel are written once, as the functions
`all_reduce_backward`, `all_gather_backward` and `copy_to_parallel_backward`: the nodes below call them, and so
do the autograd registrations of the torchrun engine's compiled operators (comm/dist_ops.py), one rank's
gradient at a time.

The functions at the end (`all_reduce`, ...) are how an engine runs one: through `Function.apply` where a gradient will
flow back, else the raw collective alone (decoding under no_grad pays for no autograd node). Without a gradient,
copy_to_parallel, split and tie communicate nothing, so their engines skip them before reaching here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.autograd import Function

from ..partition import Partition
from .interface import Collectives

_NONE2, _NONE4 = (None, None), (None, None, None, None)


def _needs_grad(xs: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


# --- the backward rules shared with the compiled operators (dist_ops.py): one gradient per rank of `ranks` ------


def all_reduce_backward(grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """dL/dy is replicated: each partial input gets it unchanged."""
    return tuple(grads)


def all_gather_backward(
    grads: Sequence[torch.Tensor], ranks: Sequence[int], partition: Partition, dim: int
) -> tuple[torch.Tensor, ...]:
    """The gathered value is replicated and so is its gradient: each rank's slice of it is its piece's gradient."""
    return tuple(partition.take(g, dim, r).contiguous() for r, g in zip(ranks, grads))


def copy_to_parallel_backward(
    grads: Sequence[torch.Tensor], reduce: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]
) -> tuple[torch.Tensor, ...]:
    """The split layers reading the copy each hold part of dL/dx: `reduce` (an all-reduce) sums them."""
    return tuple(reduce(grads))


# --- the nodes ---------------------------------------------------------------------------------------------------


class AllReduce(Function):
    @staticmethod
    def forward(ctx, c, where, *xs):
        return tuple(c.reduce(xs, op="all_reduce", where=where, phase="forward"))

    @staticmethod
    def backward(ctx, *grads):
        return (*_NONE2, *all_reduce_backward(grads))


class CopyToParallel(Function):
    @staticmethod
    def forward(ctx, c, where, *xs):
        ctx.c, ctx.where = c, where
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        c, where = ctx.c, ctx.where
        return (*_NONE2, *copy_to_parallel_backward(
            grads, lambda gs: c.reduce(gs, op="copy_to_parallel", where=where, phase="backward")))


class AllGather(Function):
    @staticmethod
    def forward(ctx, c, where, partition, dim, *xs):
        ctx.c, ctx.partition, ctx.dim = c, partition, dim
        return tuple(c.gather(xs, dim, partition, op="all_gather", where=where, phase="forward"))

    @staticmethod
    def backward(ctx, *grads):
        return (*_NONE4, *all_gather_backward(grads, ctx.c.ranks, ctx.partition, ctx.dim))


class Assemble(AllGather):
    """AllGather's result, assembled from the shards' slices into one shared whole (`OneShard.gather_into_one`: an
    in-process shard that owns its graph); the same backward (this shard's slice of the gradient)."""

    @staticmethod
    def forward(ctx, c, where, partition, dim, *xs):
        ctx.c, ctx.partition, ctx.dim = c, partition, dim
        return tuple(c.gather_into_one(xs, dim, partition, where=where))


class Split(Function):
    @staticmethod
    def forward(ctx, c, where, partition, dim, *xs):
        ctx.c, ctx.where, ctx.partition, ctx.dim = c, where, partition, dim
        return tuple(partition.take(x, dim, r).clone(memory_format=torch.contiguous_format) for r, x in zip(c.ranks, xs))

    @staticmethod
    def backward(ctx, *grads):
        grads = [g.contiguous() for g in grads]
        return (*_NONE4, *ctx.c.gather(grads, ctx.dim, ctx.partition, op="split", where=ctx.where, phase="backward"))


class Tie(Function):
    @staticmethod
    def forward(ctx, c, where, groups, *xs):
        ctx.c, ctx.where, ctx.groups = c, where, groups
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, *ctx.c.reduce_holders(grads, ctx.groups, where=ctx.where))


class ReduceScatter(Function):
    @staticmethod
    def forward(ctx, c, where, dim, *xs):
        ctx.c, ctx.where, ctx.dim = c, where, dim
        return tuple(c.reduce_scatter_even(xs, dim, where=where, phase="forward"))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, *ctx.c.gather_even(grads, ctx.dim, where=ctx.where, phase="backward"))


@dataclass
class Gathered:
    """Backward mode of one gather_sequence output: `partial` once column-parallel layers claimed it."""

    partial: bool = False


class GatherSequence(Function):
    @staticmethod
    def forward(ctx, c, where, dim, state, *xs):
        ctx.c, ctx.where, ctx.dim, ctx.state = c, where, dim, state
        return tuple(c.gather_even(xs, dim, where=where, phase="forward"))

    @staticmethod
    def backward(ctx, *grads):
        c, dim = ctx.c, ctx.dim
        if ctx.state.partial:
            # Read by column-parallel layers: each rank holds part of dL/dy; sum it and keep our slice.
            return (*_NONE4, *c.reduce_scatter_even(grads, dim, where=ctx.where, phase="backward"))
        n = grads[0].shape[dim] // c.world_size  # read as a replicated value: dL/dy is whole already
        return (*_NONE4, *(g.narrow(dim, r * n, n).contiguous() for r, g in zip(c.ranks, grads)))


class SumGrads(Function):
    """Identity on parameters whole on every shard whose gradients are partial sums (`partial_grads`): `count` of
    them per rank of `c.ranks`, rank-major. Backward: each parameter's gradients summed over the shards (None where
    no shard has one), for all of them at once."""

    @staticmethod
    def forward(ctx, c, where, count, *params):
        ctx.c, ctx.where, ctx.count = c, where, count
        ctx.set_materialize_grads(False)
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        summed = ctx.c.reduce_lists(_by_rank(grads, ctx.count), where=ctx.where)
        return (None, None, None, *[g for mine in summed for g in mine])


class GatherRows(Function):
    """All-gather of many tensors at once along dim 0 (ZeRO-3's partitioned parameters): `len(partitions)` of them
    per rank of `c.ranks`, rank-major. Backward: every shard's gradient of a whole replicated parameter is whole
    already (SPMD), so each keeps its own rows; no communication."""

    @staticmethod
    def forward(ctx, c, where, partitions, *flat):
        ctx.c, ctx.partitions = c, partitions
        return tuple(c.gather_rows(_by_rank(flat, len(partitions)), partitions, where=where))

    @staticmethod
    def backward(ctx, *grads):
        count, ranks = len(ctx.partitions), ctx.c.ranks
        rows = []
        for index, g in enumerate(grads):
            k, i = divmod(index, count)
            rows.append(None if g is None else ctx.partitions[i].take(g, 0, ranks[k]).contiguous())
        return (None, None, None, *rows)


def _by_rank(flat: Sequence, count: int) -> list[list]:
    """Rank-major `flat` (`count` per rank) as one list per rank."""
    return [list(flat[i:i + count]) for i in range(0, len(flat), count)]


# --- running one: a node where a gradient will flow back, else the raw collective ------------------------------


def all_reduce(c: Collectives, where: str, *xs: torch.Tensor) -> Sequence[torch.Tensor]:
    if _needs_grad(xs):
        return AllReduce.apply(c, where, *xs)
    return c.reduce(xs, op="all_reduce", where=where, phase="forward")


def all_gather(c: Collectives, where: str, partition: Partition, dim: int, *xs: torch.Tensor) -> Sequence[torch.Tensor]:
    if _needs_grad(xs):
        return AllGather.apply(c, where, partition, dim, *xs)
    return c.gather(xs, dim, partition, op="all_gather", where=where, phase="forward")


def assemble(c: Collectives, where: str, partition: Partition, dim: int, *xs: torch.Tensor) -> Sequence[torch.Tensor]:
    if _needs_grad(xs):
        return Assemble.apply(c, where, partition, dim, *xs)
    return c.gather_into_one(xs, dim, partition, where=where)


def reduce_scatter(c: Collectives, where: str, dim: int, *xs: torch.Tensor) -> Sequence[torch.Tensor]:
    if _needs_grad(xs):
        return ReduceScatter.apply(c, where, dim, *xs)
    return c.reduce_scatter_even(xs, dim, where=where, phase="forward")


def copy_to_parallel(c: Collectives, where: str, *xs: torch.Tensor) -> Sequence[torch.Tensor]:
    return CopyToParallel.apply(c, where, *xs)


def split(c: Collectives, where: str, partition: Partition, dim: int, *xs: torch.Tensor) -> Sequence[torch.Tensor]:
    return Split.apply(c, where, partition, dim, *xs)


def tie(c: Collectives, where: str, groups: list[list[int]], *xs: torch.Tensor) -> Sequence[torch.Tensor]:
    return Tie.apply(c, where, groups, *xs)


def gather_rows(c: Collectives, where: str, partitions: list[Partition], *flat: torch.Tensor) -> list[torch.Tensor]:
    """Rank-major `flat` gathered (GatherRows), rank-major."""
    if _needs_grad(flat):
        return list(GatherRows.apply(c, where, partitions, *flat))
    return c.gather_rows(_by_rank(flat, len(partitions)), partitions, where=where)
