"""Collectives between the worker threads of the in-process engine.

Each shard runs its forward in its own thread. When shards reach a collective, each one deposits its
tensor at a rendezvous; the last to arrive runs the collective for all of them as **one autograd node
with one input and one output per device**. The backward pass therefore needs no rendezvous at all: the
autograd engine calls that node once with every device's gradient, and it reduces them on the spot. That
is what makes `backward()` exact and unable to deadlock, on CPU (where autograd runs in one thread) as on
GPUs (one autograd thread per device).

Reductions: CUDA tensors on distinct GPUs go through NCCL (`torch.cuda.nccl`) when it is available, else
through peer copies to the first device; CPU tensors are summed in memory. Every device receives its own
copy of a result, so a shard may modify it in place. Sums run in rank order, so every shard gets a
bit-identical result and replicated activations never drift apart.

A rendezvous waits at most `timeout` seconds. A shard that raises aborts the group: every other shard
waiting at a rendezvous wakes up with `CollectiveAborted` instead of hanging.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.autograd import Function

from ..partition import Partition
from .base import Comm
from .counter import record


_current = threading.local()  # .call: the token of the call this thread is running a shard for


def enter_call(group: "ThreadGroup") -> None:
    """Mark the calling thread as running a shard of `group`'s current call."""
    _current.call = group.call


class CollectiveAborted(RuntimeError):
    """Raised in a shard waiting at a collective when another shard failed."""


@dataclass
class _Slot:
    world_size: int
    payloads: list[Any] = field(default_factory=list)
    ops: list[tuple[str, str] | None] = field(default_factory=list)
    arrived: int = 0
    results: list[Any] | None = None
    picked: int = 0

    def __post_init__(self) -> None:
        self.payloads = [None] * self.world_size
        self.ops = [None] * self.world_size


class ThreadGroup:
    """Rendezvous between the shards of one in-process model, reset before every call."""

    def __init__(self, devices: Sequence[torch.device], timeout: float, *, serial: bool = False) -> None:
        self.devices = list(devices)
        self.world_size = len(self.devices)
        self.timeout = timeout
        # serial (debug mode): one shard runs at a time; the baton passes at every rendezvous.
        self.baton = threading.RLock() if serial else None
        self._cond = threading.Condition()
        self.reset()

    def reset(self) -> None:
        """Start a new call: forget every slot, error and cached input of the previous one."""
        with self._cond:
            self.call = object()
            self._slots: dict[int, _Slot] = {}
            self._seq = [0] * self.world_size
            self._error: BaseException | None = None
            self.parallel_inputs: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in self.devices]

    def abort(self, error: BaseException, rank: int | None = None) -> None:
        """Wake every waiting shard with an error; the first error is the one reported."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def _raise_aborted(self, rank: int, op: str, where: str) -> None:
        raise CollectiveAborted(
            f"{op} at {where or '?'} on device {self.devices[rank]} (rank {rank}) stopped because another "
            f"shard failed: {type(self._error).__name__}: {self._error}"
        )

    def exchange(self, rank: int, op: str, where: str, payload: Any, compute: Callable[[list[Any]], list[Any]]) -> Any:
        """Deposit `payload`; once all shards have, `compute(payloads)` runs once; return this rank's result."""
        baton = self.baton
        with self._cond:
            if getattr(_current, "call", None) is not self.call:
                raise CollectiveAborted(
                    f"{op} at {where or '?'} ran outside the current call of its tensor-parallel model "
                    "(a shard left over from a call that timed out, or a shard module called directly)"
                )
            if self._error is not None:
                self._raise_aborted(rank, op, where)
            seq = self._seq[rank]
            self._seq[rank] += 1
            slot = self._slots.setdefault(seq, _Slot(self.world_size))
            slot.payloads[rank] = payload
            slot.ops[rank] = (op, where)
            slot.arrived += 1
            last = slot.arrived == self.world_size
        if last:
            try:
                kinds = {o for o, _ in slot.ops}
                if len(kinds) > 1:
                    seen = ", ".join(f"rank {r}: {o} at {w or '?'}" for r, (o, w) in enumerate(slot.ops))
                    raise RuntimeError(
                        f"shards called different collectives at the same step ({seen}); the shards ran "
                        "different code, e.g. data-dependent control flow on values that differ per device"
                    )
                results = compute(slot.payloads)
            except BaseException as e:
                self.abort(e, rank)
                raise
            with self._cond:
                slot.results = results
                slot.payloads = []
                self._cond.notify_all()
        else:
            if baton is not None:
                baton.release()
            try:
                self._wait(slot, rank, op, where)
            finally:
                if baton is not None:
                    baton.acquire()
        with self._cond:
            result = slot.results[rank]
            slot.picked += 1
            if slot.picked == self.world_size:
                self._slots.pop(seq, None)
            return result

    def _wait(self, slot: _Slot, rank: int, op: str, where: str) -> None:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while slot.results is None:
                if self._error is not None:
                    self._raise_aborted(rank, op, where)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [r for r in range(self.world_size) if slot.ops[r] is None]
                    who = ", ".join(f"device {self.devices[r]} (rank {r})" for r in missing)
                    error = TimeoutError(
                        f"{op} at {where or '?'}: {who} did not arrive within {self.timeout:g} s. A shard is "
                        "stuck or ran different code; raise the limit with tensor_parallel(..., timeout=S)."
                    )
                    self._error = self._error or error
                    self._cond.notify_all()
                    raise error
                self._cond.wait(remaining)


# --- reductions ----------------------------------------------------------------------------------------


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _distinct_gpus(tensors: Sequence[torch.Tensor]) -> bool:
    devs = [t.device for t in tensors]
    return all(d.type == "cuda" for d in devs) and len(set(devs)) == len(devs)


def sum_to_all(tensors: Sequence[torch.Tensor], devices: Sequence[torch.device]) -> list[torch.Tensor]:
    """Sum over devices; every device gets its own copy of the (bit-identical) result."""
    if _distinct_gpus(tensors):
        try:
            import torch.cuda.nccl as nccl

            if nccl.is_available(list(tensors)):
                outs = [torch.empty_like(t) for t in tensors]
                nccl.all_reduce([t.contiguous() for t in tensors], outputs=outs)
                return outs
        except (ImportError, RuntimeError):
            pass
    total = tensors[0].to(devices[0]) + tensors[1].to(devices[0])
    for t in tensors[2:]:
        total += t.to(devices[0])
    return [total] + [total.to(d, copy=True) for d in devices[1:]]


def copies(t: torch.Tensor, devices: Sequence[torch.device]) -> list[torch.Tensor]:
    """The first device keeps `t`; the others get their own copies."""
    return [t] + [t.to(d, copy=True) for d in devices[1:]]


# --- multi-device autograd nodes: one input and one output per device ------------------------------------


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


class ThreadComm(Comm):
    """The collectives of shard `rank` of a `ThreadGroup`."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def _exchange(self, op: str, where: str, x: Any, compute: Callable[[list[Any]], list[Any]]) -> Any:
        return self.group.exchange(self.rank, op, where, x, compute)

    def all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        devices = self.group.devices

        def compute(xs):
            if _needs_grad(xs):
                return list(_AllReduce.apply(devices, where, *xs))
            record("all_reduce", _nbytes(xs[0]), "forward", where)
            return sum_to_all(xs, devices)

        return self._exchange("all_reduce", where, x, compute)

    def copy_to_parallel(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        # Identity in forward: only needed when a gradient will flow back through x.
        if self.world_size == 1 or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        cache = self.group.parallel_inputs[self.rank]
        hit = cache.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]  # q, k and v (gate and up) share one node, so backward reduces once
        devices = self.group.devices
        y = self._exchange("copy_to_parallel", where, x, lambda xs: list(_CopyToParallel.apply(devices, where, *xs)))
        cache[id(x)] = (x, y)
        return y

    def all_gather(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        devices = self.group.devices

        def compute(xs):
            if _needs_grad(xs):
                return list(_AllGather.apply(devices, where, partition, dim, *xs))
            full = partition.assemble([t.to(devices[0]) for t in xs], dim)
            record("all_gather", _nbytes(full), "forward", where)
            return copies(full, devices)

        return self._exchange("all_gather", where, x, compute)

    def split(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        if not (torch.is_grad_enabled() and x.requires_grad):
            return partition.take(x, dim, self.rank)  # no communication without a backward pass
        devices = self.group.devices
        return self._exchange("split", where, x, lambda xs: list(_Split.apply(devices, where, partition, dim, *xs)))

    def tie(self, x: torch.Tensor, groups: list[list[int]], *, where: str = "") -> torch.Tensor:
        if self.world_size == 1 or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        devices = self.group.devices
        return self._exchange("tie", where, x, lambda xs: list(_Tie.apply(devices, where, groups, *xs)))
