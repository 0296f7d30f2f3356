"""Collectives as per-shard autograd nodes: every shard owns its graph, and shards meet in both directions.

This is how the torchrun engine's ranks work, in threads. Each collective is an autograd function of ONE
shard: its forward deposits the shard's tensor at the rendezvous (comm/rendezvous.py) and takes back the
shard's result; its backward does the same with the gradient, at the rendezvous of the backward pass. So
every shard's forward builds a graph of its own, the engine runs the shards' backward passes concurrently
(engines/inprocess/shard_backward.py), and anything that re-runs a forward inside backward (activation
checkpointing) simply meets the other shards again.

    collective          forward                       backward
    all_reduce          meet: sum                     identity
    copy_to_parallel    identity                      meet: sum
    all_gather          meet: concatenate             take own slice
    split               take own slice                meet: concatenate
    assemble            meet: one shared whole        take own slice
    tie                 identity                      meet: sum over the holders of a parameter
    partial_grads       identity                      meet: sum every parameter (comm/partial_grads.py)

The reductions are those of comm/threads.py (`sum_to_all`, `copies`): run once, by the last shard to
arrive, in rank order, so every shard gets a bit-identical result; each collective is counted once. On
CPU slots the shards compute a large collective together instead, each in its own thread, at the same time
(comm/rendezvous.py, `each`): for an all-reduce each sums one chunk of the elements (in rank order) into every
shard's result (reduce.sum_chunk_into), for an all-gather each concatenates its own copy; nothing is then
computed while the other shards wait (reduce.each_computes_its_own).

`assemble` is an all-gather whose result no shard changes afterwards (a model's output, once its forward has
returned): every shard gets a view of ONE whole tensor, into which each shard copied its own slice, in its own
thread. The logits of a causal LM (batch x seq x vocabulary) are then made once, not once per device.
"""

from __future__ import annotations

import math

import torch
from torch.autograd import Function

from .interface import Comm  # a ThreadComm (comm/threads.py), which builds these nodes
from .counter import record
from .reduce import copies, each_computes_its_own, nbytes as _nbytes, signature as _signature, sum_chunk_into, sum_to_all


def _summed(comm: Comm, op: str, where: str, x: torch.Tensor, phase: str) -> torch.Tensor:
    devices = comm.group.devices
    if each_computes_its_own(devices, _nbytes(x)):
        # Each shard brings its input and an empty result, sums its own chunk of every element into all the
        # results at once (reduce.sum_chunk_into), and returns its result once every chunk is written.
        def each(payloads, rank):
            sum_chunk_into([p[0] for p in payloads], [p[1] for p in payloads], rank)
            return payloads[rank][1]

        x = x.contiguous()
        return comm.group.exchange(
            comm.rank, op, where, (x, torch.empty_like(x)), lambda xs: record("all_reduce", _nbytes(x), phase, where),
            _signature(x), each=each,
        )

    def compute(xs):
        record("all_reduce", _nbytes(xs[0]), phase, where)
        return sum_to_all(xs, devices)

    return comm._exchange(op, where, x, compute, _signature(x))


def _gathered(comm: Comm, op: str, where: str, x: torch.Tensor, dim: int, part, phase: str) -> torch.Tensor:
    devices = comm.group.devices
    full = list(x.shape)
    full[dim] = part.size
    full_bytes = math.prod(full) * x.element_size()  # the same on every shard (its own slice may differ)
    if each_computes_its_own(devices, full_bytes):
        return comm.group.exchange(
            comm.rank, op, where, x, lambda xs: record("all_gather", full_bytes, phase, where), _signature(x, dim),
            each=lambda xs, rank: part.assemble([t.to(devices[rank]) for t in xs], dim),
        )

    def compute(xs):
        full = part.assemble([t.to(devices[0]) for t in xs], dim)
        record("all_gather", _nbytes(full), phase, where)
        return copies(full, devices)

    return comm._exchange(op, where, x, compute, _signature(x, dim))


def _assembled(comm: Comm, where: str, x: torch.Tensor, dim: int, part) -> torch.Tensor:
    devices = comm.group.devices
    full = list(x.shape)
    full[dim] = part.size
    full_bytes = math.prod(full) * x.element_size()
    if each_computes_its_own(devices, full_bytes):
        # The first shard brings the (still unwritten) whole; each copies its slice into it, all at once.
        whole = x.new_empty(full) if comm.rank == 0 else None

        def each(payloads, rank):
            out = payloads[0][1]
            part.place(out, payloads[rank][0], dim, rank)
            return out

        return comm.group.exchange(
            comm.rank, "assemble", where, (x, whole), lambda xs: record("all_gather", full_bytes, "forward", where),
            _signature(x, dim), each=each,
        )

    def compute(xs):
        out = part.assemble([t.to(devices[0]) for t in xs], dim)
        record("all_gather", full_bytes, "forward", where)
        return [out] * len(xs)

    return comm._exchange("assemble", where, x, compute, _signature(x, dim))


class AllReduce(Function):
    @staticmethod
    def forward(ctx, comm, where, x):
        return _summed(comm, "all_reduce", where, x, "forward")

    @staticmethod
    def backward(ctx, grad):
        return None, None, grad  # dL/dy is replicated: each partial input gets it unchanged


class CopyToParallel(Function):
    @staticmethod
    def forward(ctx, comm, where, x):
        ctx.comm, ctx.where = comm, where
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None, None, _summed(ctx.comm, "copy_to_parallel", ctx.where, grad, "backward")


class AllGather(Function):
    @staticmethod
    def forward(ctx, comm, where, part, dim, x):
        ctx.part, ctx.dim, ctx.rank = part, dim, comm.rank
        return _gathered(comm, "all_gather", where, x, dim, part, "forward")

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None, ctx.part.take(grad, ctx.dim, ctx.rank).contiguous()


class Assemble(AllGather):
    """AllGather's result, assembled from the shards' slices on shared storage; the same backward (this shard's
    slice of the gradient)."""

    @staticmethod
    def forward(ctx, comm, where, part, dim, x):
        ctx.part, ctx.dim, ctx.rank = part, dim, comm.rank
        whole = _assembled(comm, where, x, dim, part)
        return whole.view(whole.shape)  # a tensor of this shard's own (its graph node), on the shared storage


class Split(Function):
    @staticmethod
    def forward(ctx, comm, where, part, dim, x):
        ctx.comm, ctx.where, ctx.part, ctx.dim = comm, where, part, dim
        return part.take(x, dim, comm.rank).clone()

    @staticmethod
    def backward(ctx, grad):
        full = _gathered(ctx.comm, "split", ctx.where, grad.contiguous(), ctx.dim, ctx.part, "backward")
        return None, None, None, None, full


class Tie(Function):
    @staticmethod
    def forward(ctx, comm, where, groups, x):
        ctx.comm, ctx.where, ctx.groups = comm, where, groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        comm, groups = ctx.comm, ctx.groups
        devices = comm.group.devices

        def compute(grads):
            grads = list(grads)
            for ranks in groups:
                total = sum_to_all([grads[r] for r in ranks], [devices[r] for r in ranks])
                for r, g in zip(ranks, total):
                    grads[r] = g
            if groups:
                record("all_reduce", _nbytes(grads[0]), "backward", ctx.where)
            return grads

        return None, None, None, comm._exchange("tie", ctx.where, grad, compute, _signature(grad))
