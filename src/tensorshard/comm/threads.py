"""Collectives between the worker threads of the in-process engine: the `ThreadComm` of each shard.

Each shard runs its forward in its own thread and meets the others at each collective through a
`ThreadGroup` (comm/rendezvous.py), which bounds every wait and stops all shards of a call when one fails.
The autograd nodes are comm/functions.py's; their raw collectives come in two forms, chosen by the placement
(comm/thread_collectives.py):

- **each shard owns its graph** (CPU slots, or one shard per GPU: always, but in debug mode on a GPU): the
  shard's own node (`OneShard`), which meets the other shards in the backward pass too; every shard runs its
  own backward pass, concurrently with the others (engines/inprocess/shard_backward.py);
- **one graph spanning the devices** (debug mode on a GPU puts every shard there, and that GPU's single
  autograd thread would run all shards' backward nodes and block in the first collective): the last shard
  to arrive runs the collective as **one node with one input and one output per device** (`AllShards`).
  The backward pass then needs no rendezvous: autograd calls that node once with every device's gradient,
  and it reduces them on the spot. Activation checkpointing cannot work there (a forward recomputed in
  backward runs one shard only).

The reductions themselves are in comm/reduce.py.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from ..partition import Partition
from . import functions, thread_ops
from .interface import Comm
from .counter import record
from .partial_grads import PartialGrads
from .reduce import copies, native_collectives, nbytes as _nbytes, signature as _signature, sum_to_all
from .rendezvous import CollectiveAborted, ThreadGroup
from .thread_collectives import AllShards, OneShard
from .traced_collectives import TracedCollectives

__all__ = ["CollectiveAborted", "ThreadComm", "ThreadGroup", "copies", "native_collectives", "sum_to_all"]


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
        self.shard = OneShard(group, rank)  # this shard's own nodes (each shard owning its graph)
        self._all_shards = AllShards(group.devices)  # one node for every shard (shards sharing a device)
        self.handle = thread_ops.handle_of(self)  # its name in compiled graphs (comm/thread_ops.py)
        # while torch.compile traces a call that builds an autograd graph: comm/functions.py's nodes over these
        self.traced = TracedCollectives(self.handle, rank, group.world_size)
        self.bound = False  # bound to one call site (`at`): traced, its collectives name that site, not `where`

    def at(self, site: str) -> "ThreadComm":
        """This comm, bound to the call site `site` (a style's module name): traced into a compiled graph, its
        collectives name the site by a tensor (comm/traced_collectives.py) and never read the `where` they are
        given, which dynamo would otherwise guard on (a graph per block and shard; eagerly nothing changes)."""
        bound = copy.copy(self)
        bound.traced = TracedCollectives(self.handle, self.rank, self.world_size, site)
        bound.bound, bound.site = True, site
        bound.unbound = self  # keeps the comm its handle names alive (thread_ops holds it weakly)
        return bound

    # A call that runs compiled code may run some frames eagerly where dynamo gives up on them (past its recompile
    # limit, a frame of code many shards or models share: a transformers model's forward after a graph break, a
    # wrapper), and not necessarily the same frames on every shard: shard 0 compiled where shard 1 runs eagerly.
    # Their collectives must still meet at the rendezvous, the same operation at the same site. So in such a call
    # (group.compiled, set by the engine) an eager collective takes the path its traced form takes: a bound comm
    # names its site, as its traced form does by its site tensor (`_named_by_site`, `_traced_with_grad`), and a
    # result assembled without gradients is all-gathered into a copy per shard (as `_traced_gather`).

    def _eager_where(self, where: str) -> str:
        """The `where` an eager collective runs under (see above; a decode step's traced collectives without
        gradients keep their names, thread_ops.decode_steps)."""
        kind = self.group.compiled[self.rank]
        if self.bound and kind and (torch.is_grad_enabled() or (kind != "steps" and self.group.own_graphs)):
            return self.site
        return where

    def _traced_where(self, where: str) -> str:
        """What a traced collective passes on as its `where`: nothing when bound to a site (the site tensor names
        it; reading `where` would make dynamo guard on it)."""
        return "" if self.bound else where

    def _exchange(self, op: str, where: str, x: Any, compute: Callable[[list[Any]], list[Any]], signature: Any) -> Any:
        return self.group.exchange(self.rank, op, where, x, compute, signature)

    def _spanning(self, op: str, where: str, x: torch.Tensor, run: Callable[..., Any], signature: Any) -> torch.Tensor:
        """Shards sharing one device: the last to arrive runs `run(all_shards, *xs)`, one node for every shard
        (comm/functions.py), and each shard takes its output."""
        return self._exchange(op, where, x, lambda xs: list(run(self._all_shards, *xs)), signature)

    def _check_size(self, op: str, where: str, x: torch.Tensor, dim: int, expected: int, what: str) -> None:
        if x.shape[dim] != expected:
            raise RuntimeError(
                f"{op} at {where or '?'} on device {self.group.labels[self.rank]} (rank {self.rank}): expected "
                f"{expected} elements along dim {dim} ({what}), got shape {tuple(x.shape)}. The layer's input "
                "or output is not laid out as the plan says; check its blocks and Heads entry."
            )

    def _named_by_site(self) -> bool:
        """While tracing without gradients: the collective as an operator named by its site tensor (see `at`), where
        the shards own their graphs and no decode step is compiling (thread_ops.decode_steps)."""
        return self.bound and self.group.own_graphs and not thread_ops.decode_steps.compiling

    def _traced_with_grad(self) -> bool:
        """torch.compile is tracing a call that builds an autograd graph, on shards that own their graphs: the
        collectives are comm/functions.py's nodes over graph operators (comm/traced_collectives.py)."""
        return torch.compiler.is_compiling() and self.world_size > 1 and torch.is_grad_enabled() and self.group.own_graphs

    def all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        if torch.compiler.is_compiling() and self.world_size > 1 and not torch.is_grad_enabled():
            if self._named_by_site():
                return thread_ops.reduce(x, self.traced.key, "all_reduce", "forward")
            return thread_ops.all_reduce(x, self.handle, where)  # one operator inside the graph
        if self._traced_with_grad():
            return functions.all_reduce(self.traced, self._traced_where(where), x)[0]
        return self.eager_all_reduce(x, where=where)

    def compiling_all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        """`all_reduce`'s branch for a call dynamo traces without gradients (comm/interface.py)."""
        if self.world_size == 1:
            return self.all_reduce(x, where=where)
        if self.bound and self.group.own_graphs and not thread_ops.decode_steps.compiling:  # (`_named_by_site`)
            return thread_ops.reduce(x, self.traced.key, "all_reduce", "forward")
        return thread_ops.all_reduce(x, self.handle, where)

    @_not_compiled
    def eager_all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        where = self._eager_where(where)
        if self.group.own_graphs:
            return functions.all_reduce(self.shard, where, x)[0]
        return self._spanning("all_reduce", where, x, lambda c, *xs: functions.all_reduce(c, where, *xs), _signature(x))

    def copy_to_parallel(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        # Identity in forward: only needed when a gradient will flow back through x (traced as such when compiled).
        if self.world_size == 1 or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        if self._traced_with_grad():
            # q, k and v (gate and up) reading one tensor share one node, as below: remembered on the tensor,
            # which dynamo traces (the dictionary below is keyed by id(), which it cannot)
            hit = getattr(x, "_tensorshard_parallel_copy", None)
            if hit is not None:
                return hit
            y = x._tensorshard_parallel_copy = functions.copy_to_parallel(self.traced, self._traced_where(where), x)[0]
            return y
        return self._copy_to_parallel(x, where=where)

    @_not_compiled
    def _copy_to_parallel(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        where = self._eager_where(where)
        cache = self.group.parallel_inputs(self.rank, "copy_to_parallel", where)
        hit = cache.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]  # q, k and v (gate and up) share one node, so backward reduces once
        if self.group.own_graphs:
            y = functions.copy_to_parallel(self.shard, where, x)[0]
        else:
            run = lambda c, *xs: functions.copy_to_parallel(c, where, *xs)  # noqa: E731
            y = self._spanning("copy_to_parallel", where, x, run, _signature(x))
        cache[id(x)] = (x, y)
        return y

    def all_gather(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor:
        left = self.group.left_split[self.rank]
        if self.world_size == 1 or (left and where in left):  # (`where` read only when some output is left split)
            return x
        traced = self._traced_gather(x, dim, partition, where)
        return traced if traced is not None else self.eager_all_gather(x, dim, partition, where=where)

    def _traced_gather(self, x: torch.Tensor, dim: int, partition: Partition, where: str) -> torch.Tensor | None:
        """While torch.compile traces a call without gradients: the all-gather as one operator of its graph."""
        if torch.compiler.is_compiling() and self.world_size > 1 and not torch.is_grad_enabled():
            if self._named_by_site():
                dim = self._slice_dim("all_gather", where, x, dim, partition)
                return thread_ops.gather(x, self.traced.key, dim, thread_ops.layout_of(partition), "all_gather", "forward")
            return thread_ops.all_gather(x, self.handle, dim % x.dim(), thread_ops.layout_of(partition), where)
        if self._traced_with_grad():
            dim = self._slice_dim("all_gather", where, x, dim, partition)
            return functions.all_gather(self.traced, self._traced_where(where), partition, dim, x)[0]
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
        where = self._eager_where(where)
        dim = self._slice_dim("all_gather", where, x, dim, partition)
        if self.group.own_graphs:
            return functions.all_gather(self.shard, where, partition, dim, x)[0]
        run = lambda c, *xs: functions.all_gather(c, where, partition, dim, *xs)  # noqa: E731
        return self._spanning("all_gather", where, x, run, _signature(x, dim))

    def all_reduce_max(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        """The elementwise max over the shards, each getting its own copy; no gradient (a loss's stability shift)."""
        if torch.compiler.is_compiling() and self.world_size > 1:
            return thread_ops.all_reduce_max(x.detach(), self.handle, where)  # one operator inside the graph
        return self._all_reduce_max(x, where=where)

    @_not_compiled
    def _all_reduce_max(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
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
        of one whole tensor, each having copied its slice into it (comm/thread_collectives.py). Shards that own their
        graphs only: the caller checks `group.own_graphs`. Compiled, every shard gets a whole copy instead."""
        if self._traced_with_grad():
            dim = self._slice_dim("assemble", where, x, dim, partition)
            return functions.assemble(self.traced, self._traced_where(where), partition, dim, x)[0]
        traced = self._traced_gather(x, dim, partition, where)
        return traced if traced is not None else self._assemble(x, dim, partition, where=where)

    @_not_compiled
    def _assemble(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        if self.group.compiled[self.rank] in ("shards", "steps") and not torch.is_grad_enabled():
            return self.eager_all_gather(x, dim, partition, where=where)  # as traced (`_traced_gather`)
        where = self._eager_where(where)
        return functions.assemble(self.shard, where, partition, self._slice_dim("assemble", where, x, dim, partition), x)[0]

    def split(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        dim %= x.dim()
        self._check_size("split", where, x, dim, partition.size, "the whole dimension")
        if not (torch.is_grad_enabled() and x.requires_grad):
            # No communication without a backward pass: a slice, traced into a compiled graph as it is (the fast
            # decoding path of a model with per-head inputs, BLOOM's ALiBi, keeps one graph per shard)
            return partition.take(x, dim, self.rank)
        if self._traced_with_grad():
            return functions.split(self.traced, self._traced_where(where), partition, dim, x)[0]
        return self._split(x, dim, partition, where=where)

    @_not_compiled
    def _split(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor:
        where = self._eager_where(where)
        if self.group.own_graphs:
            return functions.split(self.shard, where, partition, dim, x)[0]
        run = lambda c, *xs: functions.split(c, where, partition, dim, *xs)  # noqa: E731
        return self._spanning("split", where, x, run, _signature(x))

    def tie(self, x: torch.Tensor, groups: list[list[int]], *, where: str = "") -> torch.Tensor:
        if self._traced_with_grad() and x.requires_grad:
            return functions.tie(self.traced, self._traced_where(where), groups, x)[0]
        return self._tie(x, groups, where=where)

    @_not_compiled
    def _tie(self, x: torch.Tensor, groups: list[list[int]], *, where: str = "") -> torch.Tensor:
        if self.world_size == 1 or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        where = self._eager_where(where)
        if self.group.own_graphs:
            return functions.tie(self.shard, where, groups, x)[0]
        return self._spanning("tie", where, x, lambda c, *xs: functions.tie(c, where, groups, *xs), _signature(x))

    def partial_grads(self, module, names, *, where: str = "") -> None:
        """`module`'s parameters `names` get partial gradients on each device: summed once per backward pass
        for all of them (comm/partial_grads.py; the engine installs the hooks)."""
        if self.world_size == 1:
            return
        partial = getattr(self.group, "partial_grads", None)
        if partial is None:
            partial = self.group.partial_grads = PartialGrads(self.group)
        partial.register(module, list(names), self.rank, where)
