"""The in-process engine's raw collectives (no autograd), in the two forms its placements need.

- `OneShard`: the collectives of one shard that owns its graph (CPU slots, one shard per GPU). It deposits its
  tensor at the rendezvous (comm/rendezvous.py) and takes back its result, in the forward pass and, from the
  nodes of comm/functions.py, in the backward pass too: every shard builds a graph of its own, the engine runs
  the shards' backward passes concurrently (engines/inprocess/shard_backward.py), and anything that re-runs a
  forward inside backward (activation checkpointing) simply meets the other shards again.
- `AllShards`: every shard's tensors at once, for shards that share one accelerator (debug mode on a GPU), whose
  single autograd thread would run all shards' backward nodes and block in the first rendezvous. The last shard
  to arrive runs the collective for all (comm/threads.py) as ONE node with an input and an output per shard; the
  backward pass then needs no rendezvous: autograd calls that node once with every shard's gradient.

Both reduce as comm/reduce.py does (`sum_to_all`, `copies`): once, by the last shard to arrive, in rank order, so
every shard gets a bit-identical result; each collective is counted once. On CPU slots `OneShard`'s shards compute
a large collective together instead, each in its own thread, at the same time (`each`): for an all-reduce each
sums one chunk of the elements (in rank order) into every shard's result (reduce.sum_chunk_into), for an
all-gather each concatenates its own copy; nothing is then computed while the other shards wait
(reduce.each_computes_its_own).

`OneShard.gather_into_one` is an all-gather whose result no shard changes afterwards (a model's output, once its
forward has returned): every shard gets a view of ONE whole tensor, into which each shard copied its own slice, in
its own thread. The logits of a causal LM (batch x seq x vocabulary) are then made once, not once per device.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..partition import Partition
from .counter import record
from .interface import Collectives
from .reduce import copies, each_computes_its_own, nbytes as _nbytes, signature as _signature, sum_chunk_into, sum_to_all
from .rendezvous import ThreadGroup


def _whole_bytes(x: torch.Tensor, dim: int, partition: Partition) -> int:
    """The bytes of the gathered tensor: the same on every shard (its own slice may differ)."""
    full = list(x.shape)
    full[dim] = partition.size
    return math.prod(full) * x.element_size()


def _gathered(xs: Sequence[torch.Tensor], dim: int, partition: Partition, devices, where: str, phase: str) -> list:
    full = partition.assemble([t.to(devices[0]) for t in xs], dim)
    record("all_gather", _nbytes(full), phase, where)
    return copies(full, devices)


def _holders_summed(grads: Sequence[torch.Tensor], groups: list[list[int]], devices, where: str) -> list:
    grads = list(grads)
    for ranks in groups:
        total = sum_to_all([grads[r] for r in ranks], [devices[r] for r in ranks])
        for r, g in zip(ranks, total):
            grads[r] = g
    if groups:
        record("all_reduce", _nbytes(grads[0]), "backward", where)
    return grads


def _lists_summed(payloads: Sequence[list[torch.Tensor | None]], devices, where: str) -> list[list[torch.Tensor | None]]:
    """Each position's tensors summed in rank order; every device its own copy (None where no rank has one)."""
    world = len(payloads)
    out: list[list[torch.Tensor | None]] = [[None] * len(payloads[0]) for _ in range(world)]
    total = 0
    for i in range(len(payloads[0])):
        summed = None
        for per_rank in payloads:
            g = per_rank[i]
            if g is not None:
                summed = g.to(devices[0]).clone() if summed is None else summed + g.to(devices[0])
        if summed is None:
            continue
        total += summed.numel() * summed.element_size()
        for r in range(world):
            out[r][i] = summed if r == 0 else summed.to(devices[r], copy=True)
    if total:
        record("all_reduce", total, "backward", where)
    return out


def _rows_gathered(payloads: Sequence[list[torch.Tensor]], partitions: Sequence[Partition], devices, where: str) -> list:
    """Every rank's slices of each tensor (rows, dim 0) -> each whole tensor on every rank's device, rank-major."""
    world, count = len(payloads), len(partitions)
    record("all_gather", sum(p.size * _row_bytes(t) for p, t in zip(partitions, payloads[0])), "forward", where)
    fulls = [part.assemble([payloads[r][i].detach().to(devices[0]) for r in range(world)], 0)
             for i, part in enumerate(partitions)]
    return [fulls[i] if r == 0 else fulls[i].to(devices[r], copy=True) for r in range(world) for i in range(count)]


def _row_bytes(t: torch.Tensor) -> int:
    return (t.numel() // max(t.shape[0], 1)) * t.element_size()


class OneShard(Collectives):
    """Shard `rank`'s raw collectives: each a meeting with the other shards at `group`'s rendezvous."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world_size
        self.ranks = (rank,)

    def reduce(self, xs, *, op, where, phase):
        x, devices = xs[0], self.group.devices
        if each_computes_its_own(devices, _nbytes(x)):
            # Each shard brings its input and an empty result, sums its own chunk of every element into all the
            # results at once (reduce.sum_chunk_into), and returns its result once every chunk is written.
            def each(payloads, rank):
                sum_chunk_into([p[0] for p in payloads], [p[1] for p in payloads], rank)
                return payloads[rank][1]

            x = x.contiguous()
            return [self.group.exchange(
                self.rank, op, where, (x, torch.empty_like(x)), lambda _: record("all_reduce", _nbytes(x), phase, where),
                _signature(x), each=each,
            )]

        def compute(xs):
            record("all_reduce", _nbytes(xs[0]), phase, where)
            return sum_to_all(xs, devices)

        return [self.group.exchange(self.rank, op, where, x, compute, _signature(x))]

    def gather(self, xs, dim, partition, *, op, where, phase):
        x, devices = xs[0], self.group.devices
        full_bytes = _whole_bytes(x, dim, partition)
        if each_computes_its_own(devices, full_bytes):
            return [self.group.exchange(
                self.rank, op, where, x, lambda _: record("all_gather", full_bytes, phase, where), _signature(x, dim),
                each=lambda xs, rank: partition.assemble([t.to(devices[rank]) for t in xs], dim),
            )]
        compute = lambda xs: _gathered(xs, dim, partition, devices, where, phase)  # noqa: E731
        return [self.group.exchange(self.rank, op, where, x, compute, _signature(x, dim))]

    def gather_into_one(self, xs, dim: int, partition: Partition, *, where: str) -> list[torch.Tensor]:
        """`gather` into one whole shared by every shard; each gets a view of it (a tensor object of its own)."""
        x, devices = xs[0], self.group.devices
        full_bytes = _whole_bytes(x, dim, partition)
        if each_computes_its_own(devices, full_bytes):
            # The first shard brings the (still unwritten) whole; each copies its slice into it, all at once.
            full = list(x.shape)
            full[dim] = partition.size
            whole = x.new_empty(full) if self.rank == 0 else None

            def each(payloads, rank):
                out = payloads[0][1]
                partition.place(out, payloads[rank][0], dim, rank)
                return out

            out = self.group.exchange(
                self.rank, "assemble", where, (x, whole), lambda _: record("all_gather", full_bytes, "forward", where),
                _signature(x, dim), each=each,
            )
        else:
            def compute(xs):
                out = partition.assemble([t.to(devices[0]) for t in xs], dim)
                record("all_gather", full_bytes, "forward", where)
                return [out] * len(xs)

            out = self.group.exchange(self.rank, "assemble", where, x, compute, _signature(x, dim))
        return [out.view(out.shape)]

    def reduce_holders(self, xs, groups, *, where):
        devices = self.group.devices
        compute = lambda grads: _holders_summed(grads, groups, devices, where)  # noqa: E731
        return [self.group.exchange(self.rank, "tie", where, xs[0], compute, _signature(xs[0]))]

    def reduce_lists(self, per_rank, *, where):
        devices, mine = self.group.devices, per_rank[0]
        compute = lambda payloads: _lists_summed(payloads, devices, where)  # noqa: E731
        return [self.group.exchange(self.rank, "partial_grads", where, mine, compute, len(mine))]

    def gather_rows(self, per_rank, partitions, *, where):
        devices, count = self.group.devices, len(partitions)

        def compute(payloads):
            flat = _rows_gathered(payloads, partitions, devices, where)
            return [flat[r * count:(r + 1) * count] for r in range(len(payloads))]

        return self.group.exchange(self.rank, "all_gather", where, per_rank[0], compute)


class AllShards(Collectives):
    """Every shard's raw collectives at once, computed where they are called (no rendezvous): the nodes of shards
    that share one accelerator, run by the last shard to arrive with every shard's tensor."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self.world_size = len(self.devices)
        self.ranks = range(self.world_size)

    def reduce(self, xs, *, op, where, phase):
        record("all_reduce", _nbytes(xs[0]), phase, where)
        return sum_to_all(xs, self.devices)

    def gather(self, xs, dim, partition, *, op, where, phase):
        return _gathered(xs, dim, partition, self.devices, where, phase)

    def reduce_holders(self, xs, groups, *, where):
        return _holders_summed(xs, groups, self.devices, where)

    def reduce_lists(self, per_rank, *, where):
        return _lists_summed(per_rank, self.devices, where)

    def gather_rows(self, per_rank, partitions, *, where):
        return _rows_gathered(per_rank, partitions, self.devices, where)
