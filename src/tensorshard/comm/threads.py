"""Collectives between the worker threads of the in-process engine.

Each shard runs its forward in its own thread and meets the others at each collective through a
`ThreadGroup` (comm/rendezvous.py), which bounds every wait and stops all shards of a call when one fails.
The autograd side comes in two forms, chosen by the placement:

- **each shard owns its graph** (CPU slots, or one shard per GPU: always, but in debug mode on a GPU):
  collectives are per-shard autograd nodes (comm/per_shard.py) that meet in the backward pass too, and
  every shard runs its own backward pass, concurrently with the others (engines/inprocess/shard_backward.py);
- **one graph spanning the devices** (debug mode on a GPU puts every shard there, and that GPU's single
  autograd thread would run all shards' backward nodes and block in the first collective): the last shard
  to arrive runs the collective as **one autograd node with one input and one output per device** (below).
  The backward pass then needs no rendezvous: autograd calls that node once with every device's gradient,
  and it reduces them on the spot. Activation checkpointing cannot work there (a forward recomputed in
  backward runs one shard only).

The reductions themselves are in comm/reduce.py.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.autograd import Function

from ..partition import Partition
from . import compiled, per_shard
from .interface import Comm
from .counter import record
from .partial_grads import PartialGrads
from .reduce import copies, native_collectives, nbytes as _nbytes, signature as _signature, sum_to_all
from .rendezvous import CollectiveAborted, ThreadGroup

__all__ = ["CollectiveAborted", "ThreadComm", "ThreadGroup", "copies", "native_collectives", "sum_to_all"]


# --- one graph spanning the devices: one autograd node, one input and one output per device -------------


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, devices, where, *xs):
        record("all_reduce", _nbytes(xs[0]), "forward", where)
        return tuple(sum_to_all(xs, devices))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *grads)  # dL/dy is replicated: each partial input gets it unchanged


class _CopyToParallel(Function):
    @staticmethod
    def forward(ctx, devices, where, *xs):
        ctx.devices, ctx.where = devices, where
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        record("all_reduce", _nbytes(grads[0]), "backward", ctx.where)
        return (None, None, *sum_to_all(grads, ctx.devices))


class _AllGather(Function):
    @staticmethod
    def forward(ctx, devices, where, part, dim, *xs):
        ctx.part, ctx.dim = part, dim
        full = part.assemble([x.to(devices[0]) for x in xs], dim)
        record("all_gather", _nbytes(full), "forward", where)
        return tuple(copies(full, devices))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, None, *(ctx.part.take(g, ctx.dim, r).contiguous() for r, g in enumerate(grads)))


class _Split(Function):
    @staticmethod
    def forward(ctx, devices, where, part, dim, *xs):
        ctx.devices, ctx.where, ctx.part, ctx.dim = devices, where, part, dim
        return tuple(part.take(x, dim, r).clone() for r, x in enumerate(xs))

    @staticmethod
    def backward(ctx, *grads):
        full = ctx.part.assemble([g.to(ctx.devices[0]) for g in grads], ctx.dim)
        record("all_gather", _nbytes(full), "backward", ctx.where)
        return (None, None, None, None, *copies(full, ctx.devices))


class _Tie(Function):
    @staticmethod
    def forward(ctx, devices, where, groups, *xs):
        ctx.devices, ctx.where, ctx.groups = devices, where, groups
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        grads = list(grads)
        for ranks in ctx.groups:
            summed = sum_to_all([grads[r] for r in ranks], [ctx.devices[r] for r in ranks])
            for r, g in zip(ranks, summed):
                grads[r] = g
        if ctx.groups:
            record("all_reduce", _nbytes(grads[0]), "backward", ctx.where)
        return (None, None, None, *grads)


def _needs_grad(xs: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def _node(function: type[Function], *args: Any) -> torch.Tensor:
    """`function.apply(*args)` (a collective of comm/per_shard.py; its tensor comes last), or, where that tensor
    needs no gradient (a call under no_grad: decoding), its forward alone: the same result, without the few
    microseconds `Function.apply` costs per collective. Safe to mix between shards: none of these nodes meets
    the other shards in backward."""
    if torch.is_grad_enabled() and args[-1].requires_grad:
        return function.apply(*args)
    return function.forward(_NoContext(), *args)


class _NoContext:
    """Where a collective's forward, called without `Function.apply`, leaves what its backward would need."""


def _not_compiled(fn):
    """torch.compile leaves a collective out of its graphs (one graph break each) instead of tracing a
    rendezvous of threads: traced, each call site's constant `where` string became a guard, so dynamo
    recompiled once per site until its recompile limit and then ran the rest of the model uncompiled.
    (A plain wrapper that calls the disabled function only while compiling is cheaper in eager mode, but
    dynamo compiles that wrapper's own frame, guarding on `where` again.)"""
    return torch.compiler.disable(fn)


class ThreadComm(Comm):
    """The collectives of shard `rank` of a `ThreadGroup`."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world_size
        self.handle = compiled.handle_of(self)  # its name in compiled graphs (comm/compiled.py)

    def _exchange(self, op: str, where: str, x: Any, compute: Callable[[list[Any]], list[Any]], signature: Any) -> Any:
        return self.group.exchange(self.rank, op, where, x, compute, signature)

    def _check_size(self, op: str, where: str, x: torch.Tensor, dim: int, expected: int, what: str) -> None:
        if x.shape[dim] != expected:
            raise RuntimeError(
                f"{op} at {where or '?'} on device {self.group.labels[self.rank]} (rank {self.rank}): expected "
                f"{expected} elements along dim {dim} ({what}), got shape {tuple(x.shape)}. The layer's input "
                "or output is not laid out as the plan says; check its blocks and Heads entry."
            )

    def all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        if torch.compiler.is_compiling() and self.world_size > 1 and not torch.is_grad_enabled():
            return compiled.all_reduce(x, self.handle, where)  # one operator inside the graph
        return self.eager_all_reduce(x, where=where)

    @_not_compiled
    def eager_all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        if self.group.own_graphs:
            return _node(per_shard.AllReduce, self, where, x)
        devices = self.group.devices

        def compute(xs):
            if _needs_grad(xs):
                return list(_AllReduce.apply(devices, where, *xs))
            record("all_reduce", _nbytes(xs[0]), "forward", where)
            return sum_to_all(xs, devices)

        return self._exchange("all_reduce", where, x, compute, _signature(x))

    def copy_to_parallel(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        # Identity in forward: only needed when a gradient will flow back through x (traced as such when compiled).
        if self.world_size == 1 or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        return self._copy_to_parallel(x, where=where)

    @_not_compiled
    def _copy_to_parallel(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        cache = self.group.parallel_inputs(self.rank, "copy_to_parallel", where)
        hit = cache.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]  # q, k and v (gate and up) share one node, so backward reduces once
        devices = self.group.devices
        y = per_shard.CopyToParallel.apply(self, where, x) if self.group.own_graphs else self._exchange(
            "copy_to_parallel", where, x, lambda xs: list(_CopyToParallel.apply(devices, where, *xs)), _signature(x)
        )
        cache[id(x)] = (x, y)
        return y

    def all_gather(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1 or where in self.group.left_split[self.rank]:
            return x
        traced = self._traced_gather(x, dim, partition, where)
        return traced if traced is not None else self.eager_all_gather(x, dim, partition, where=where)

    def _traced_gather(self, x: torch.Tensor, dim: int, partition: Partition, where: str) -> torch.Tensor | None:
        """While torch.compile traces a call without gradients: the all-gather as one operator of its graph."""
        if torch.compiler.is_compiling() and self.world_size > 1 and not torch.is_grad_enabled():
            return compiled.all_gather(x, self.handle, dim % x.dim(), compiled.layout_of(partition), where)
        return None

    def _slice_dim(self, op: str, where: str, x: torch.Tensor, dim: int, partition: Partition) -> int:
        """`dim` as a non-negative index, once `x` is checked to hold this device's slice along it."""
        dim %= x.dim()
        self._check_size(op, where, x, dim, partition.local_size(self.rank), f"this device's slice of {partition.size}")
        return dim

    @_not_compiled
    def eager_all_gather(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor:
        """The all-gather itself (`all_gather` without the check for an output left split)."""
        if self.world_size == 1:
            return x
        dim = self._slice_dim("all_gather", where, x, dim, partition)
        if self.group.own_graphs:
            return _node(per_shard.AllGather, self, where, partition, dim, x)
        devices = self.group.devices

        def compute(xs):
            if _needs_grad(xs):
                return list(_AllGather.apply(devices, where, partition, dim, *xs))
            full = partition.assemble([t.to(devices[0]) for t in xs], dim)
            record("all_gather", _nbytes(full), "forward", where)
            return copies(full, devices)

        return self._exchange("all_gather", where, x, compute, _signature(x, dim))

    @_not_compiled
    def all_reduce_max(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        """The elementwise max over the shards, each getting its own copy; no gradient (a loss's stability shift)."""
        if self.world_size == 1:
            return x.detach().clone()
        devices = self.group.devices

        def compute(xs):
            record("all_reduce", _nbytes(xs[0]), "forward", where)
            top = xs[0].detach().to(devices[0])
            for t in xs[1:]:
                top = torch.maximum(top, t.detach().to(devices[0]))
            return copies(top, devices)

        return self._exchange("all_reduce_max", where, x, compute, _signature(x))

    @contextmanager
    def leave_split(self, where: str) -> Iterator[None]:
        """While inside, the all-gather at `where` (a column layer's gather_output) hands back this shard's slice,
        for a caller that assembles the whole later (`assemble`; integrations/transformers/split_logits.py)."""
        left = self.group.left_split[self.rank]  # shared by every ThreadComm of this shard (styles hold their own)
        left.add(where)
        try:
            yield
        finally:
            left.discard(where)

    def assemble(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor:
        """The all-gather of a result no shard changes afterwards (a model's output): every shard gets a view
        of one whole tensor, each having copied its slice into it (comm/per_shard.py). Shards that own their
        graphs only: the caller checks `group.own_graphs`. Compiled, every shard gets a whole copy instead."""
        traced = self._traced_gather(x, dim, partition, where)
        return traced if traced is not None else self._assemble(x, dim, partition, where=where)

    @_not_compiled
    def _assemble(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        return _node(per_shard.Assemble, self, where, partition, self._slice_dim("assemble", where, x, dim, partition), x)

    @_not_compiled
    def split(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        dim %= x.dim()
        self._check_size("split", where, x, dim, partition.size, "the whole dimension")
        if not (torch.is_grad_enabled() and x.requires_grad):
            return partition.take(x, dim, self.rank)  # no communication without a backward pass
        if self.group.own_graphs:
            return per_shard.Split.apply(self, where, partition, dim, x)
        devices = self.group.devices
        return self._exchange(
            "split", where, x, lambda xs: list(_Split.apply(devices, where, partition, dim, *xs)), _signature(x)
        )

    @_not_compiled
    def tie(self, x: torch.Tensor, groups: list[list[int]], *, where: str = "") -> torch.Tensor:
        if self.world_size == 1 or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        if self.group.own_graphs:
            return per_shard.Tie.apply(self, where, groups, x)
        devices = self.group.devices
        return self._exchange("tie", where, x, lambda xs: list(_Tie.apply(devices, where, groups, *xs)), _signature(x))

    def partial_grads(self, module, names, *, where: str = "") -> None:
        """`module`'s parameters `names` get partial gradients on each device: summed once per backward pass
        for all of them (comm/partial_grads.py; the engine installs the hooks)."""
        if self.world_size == 1:
            return
        partial = getattr(self.group, "partial_grads", None)
        if partial is None:
            partial = self.group.partial_grads = PartialGrads(self.group)
        partial.register(module, list(names), self.rank, where)
