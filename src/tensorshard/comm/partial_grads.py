"""Replicated parameters whose gradients are partial sums, in the in-process engine.

Some parameters stay whole on every device but see only part of the computation: the A matrix of a LoRA
adapter beside a column-parallel layer (each device's B reads only its output slice), the B matrix beside a
row-parallel one (each device's A reads only its input slice). Each copy's gradient is then a partial sum;
the true gradient is their sum over the devices.

Rather than one all-reduce per parameter as it is used, their gradients are collected during backward and
summed in ONE reduction at the end of the backward pass (counted as one ``all_reduce`` at "partial
gradients"), then added to every copy's ``.grad``: the copies stay identical and match the unsplit model.
Reducing each pass's own contribution (not ``.grad``) keeps gradient accumulation exact. The torchrun
engine does the same with its `PartialGradBucket` (comm/dist.py).
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch
from torch import nn
from torch.autograd import Function, Variable

from .counter import record

WHERE = "partial gradients"


class _Defer(Function):
    """Identity whose backward hands this device's gradient to the bucket instead of the parameter."""

    @staticmethod
    def forward(ctx, local, bucket, key, rank, param):
        ctx.bucket, ctx.key, ctx.rank, ctx.param = bucket, key, rank, param
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        ctx.bucket.add(ctx.key, ctx.rank, ctx.param, grad)
        return None, None, None, None, None


class GradBucket:
    """The partial gradients of one backward pass, by parameter name and device, summed when it ends."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self.names: set[str] = set()  # names (in the shards) of the parameters registered here
        self._lock = threading.Lock()
        self._pending: dict[str, dict[int, tuple[nn.Parameter, torch.Tensor]]] = {}
        self._queued = False

    def wrap(self, module: nn.Module, names: Sequence[str], rank: int, where: str) -> None:
        """Route the gradients of `module`'s parameters `names` on shard `rank` through this bucket."""
        self.names.update(f"{where}.{n}" if where else n for n in names)
        inner = module.forward

        def forward(*args, **kwargs):
            own = {n: module._parameters[n] for n in names}
            if not torch.is_grad_enabled() or not any(p is not None and p.requires_grad for p in own.values()):
                return inner(*args, **kwargs)
            for n, p in own.items():
                if p is not None and p.requires_grad:
                    module._parameters[n] = _Defer.apply(p, self, f"{where}.{n}", rank, p)
            try:
                return inner(*args, **kwargs)
            finally:
                module._parameters.update(own)

        module.forward = forward

    def add(self, key: str, rank: int, param: nn.Parameter, grad: torch.Tensor) -> None:
        with self._lock:
            if not self._queued:
                Variable._execution_engine.queue_callback(self.flush)
                self._queued = True
            per_rank = self._pending.setdefault(key, {})
            seen = per_rank.get(rank)
            per_rank[rank] = (param, grad if seen is None else seen[1] + grad)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending, self._queued = self._pending, {}, False
        if not pending:
            return
        total = 0
        with torch.no_grad():
            for per_rank in pending.values():
                first = next(iter(per_rank.values()))[1]
                grads = [per_rank[r][1].to(self.devices[0]) if r in per_rank else torch.zeros_like(first, device=self.devices[0])
                         for r in range(len(self.devices))]
                summed = grads[0].clone()
                for g in grads[1:]:
                    summed += g  # rank order: every copy gets the bit-identical sum
                total += summed.numel() * summed.element_size()
                for rank, (param, _) in per_rank.items():
                    g = summed.to(self.devices[rank], copy=True)
                    if param.grad is None:
                        param.grad = g
                    else:
                        param.grad += g
        record("all_reduce", total, "backward", f"{WHERE} ({len(pending)} tensors)")
