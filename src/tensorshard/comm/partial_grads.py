"""Replicated parameters whose gradients are partial sums, in the in-process engine.

Some parameters stay whole on every device but see only part of the computation: the A matrix of a LoRA
adapter beside a column-parallel layer (each device's B reads only its output slice), the B matrix beside a
row-parallel one (each device's A reads only its input slice). Each copy's gradient is then a partial sum;
the true gradient is their sum over the devices.

Rather than one all-reduce per parameter as it is used, every shard passes all such parameters, at the
start of each forward call, through ONE multi-device autograd node (identity forward). Autograd calls its
backward once every use has contributed, with every device's gradients at once: it sums them (counted as
one ``all_reduce`` at "partial gradients") and hands each device the sum. The copies stay identical and
match the unsplit model; gradient accumulation and ZeRO-3 compose (the node reads the gathered tensors,
whose backward then keeps each device's rows). The torchrun engine does the same job with its
`PartialGradBucket` (comm/dist.py).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.autograd import Function

from .counter import record

WHERE = "partial gradients"


class _SumGrads(Function):
    """Identity on (rank-major) every device's parameters; backward: each parameter's gradients summed over devices."""

    @staticmethod
    def forward(ctx, devices, count, *flat):
        ctx.devices, ctx.count = devices, count
        return tuple(p.view_as(p) for p in flat)

    @staticmethod
    def backward(ctx, *grads):
        world, count, devices = len(ctx.devices), ctx.count, ctx.devices
        out: list[torch.Tensor | None] = [None] * len(grads)
        total = 0
        for i in range(count):
            per_rank = [grads[r * count + i] for r in range(world)]
            if all(g is None for g in per_rank):
                continue
            summed = None
            for g in per_rank:  # rank order: every device gets the bit-identical sum
                if g is not None:
                    summed = g.to(devices[0]).clone() if summed is None else summed + g.to(devices[0])
            total += summed.numel() * summed.element_size()
            for r in range(world):
                out[r * count + i] = summed if r == 0 else summed.to(devices[r], copy=True)
        if total:
            record("all_reduce", total, "backward", WHERE)
        return (None, None, *out)


class PartialGrads:
    """The parameters with partial gradients of every shard, and the hooks that route them through `_SumGrads`."""

    def __init__(self, group) -> None:
        self.group = group
        self.owners: list[list[tuple[nn.Module, str]]] = [[] for _ in range(group.world_size)]
        self.names: set[str] = set()  # their names in the shards (ZeRO-3 and checkpoints know them by name)
        self._saved: list[list[torch.Tensor] | None] = [None] * group.world_size
        self._depth = [0] * group.world_size  # nested hooked calls (a view's module inside the root's call) route once
        self._installed: set[int] = set()

    def register(self, module: nn.Module, names: Sequence[str], rank: int, where: str) -> None:
        self.owners[rank].extend((module, n) for n in names)
        self.names.update(f"{where}.{n}" if where else n for n in names)

    def install(self, shards: Sequence[nn.Module]) -> None:
        """Hook every shard's forward (or a view's modules: TensorParallel.view), after ZeRO-3's hooks so the
        node reads gathered tensors; idempotent."""
        for rank, shard in enumerate(shards):
            if id(shard) not in self._installed:
                shard.register_forward_pre_hook(self._before(rank))
                shard.register_forward_hook(self._after(rank), prepend=True, always_call=True)  # before ZeRO-3 releases
                self._installed.add(id(shard))

    def _before(self, rank: int):
        def hook(module, args):
            owners = self.owners[rank]
            self._depth[rank] += 1
            if self._depth[rank] > 1 or not owners or not torch.is_grad_enabled():
                return
            current = [m._parameters[n] for m, n in owners]
            self._saved[rank] = current
            views = self.group.exchange(rank, "partial_grads", WHERE, current, self._route)
            for (m, n), v in zip(owners, views):
                m._parameters[n] = v

        return hook

    def _after(self, rank: int):
        def hook(module, args, output):
            self._depth[rank] = max(self._depth[rank] - 1, 0)
            if self._depth[rank] > 0:
                return
            saved, self._saved[rank] = self._saved[rank], None
            if saved is not None:
                for (m, n), p in zip(self.owners[rank], saved):
                    m._parameters[n] = p

        return hook

    def _route(self, payloads: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Runs once per call, in the last shard to arrive."""
        count = len(payloads[0])
        outs = _SumGrads.apply(self.group.devices, count, *[p for per_rank in payloads for p in per_rank])
        return [list(outs[r * count:(r + 1) * count]) for r in range(len(payloads))]
