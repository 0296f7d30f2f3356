"""Gradients that are partial sums over the torchrun engine's group, summed once per backward pass.

Parameters whole on every rank that see only part of the computation (a norm running on sequence shards:
`partial_grads` in comm/interface.py) get a partial gradient on each rank. Each goes through `DeferGrad` (an
identity whose backward hands the gradient to the bucket instead of the parameter); at the end of the backward
pass `PartialGradBucket` all-reduces them all, one all-reduce per dtype, and adds the sums to the parameters'
`.grad`. The in-process engine does the same job with comm/partial_grads.py.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.autograd import Function, Variable
from torch.distributed.tensor import DTensor

from .counter import record
from .process_group import label, nbytes as _nbytes
from .transport import all_reduce_


class DeferGrad(Function):
    """Identity whose backward hands the gradient to a bucket instead of the parameter."""

    @staticmethod
    def forward(ctx, local, bucket, param):
        ctx.bucket, ctx.param = bucket, param
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        ctx.bucket.add(ctx.param, grad)
        return None, None, None


class PartialGradBucket:
    """Partial gradients of replicated parameters (modules running on sequence shards), reduced in one
    all-reduce per dtype at the end of each backward pass and then added to the parameters' `.grad`.

    Reducing each pass's own contribution (not `.grad`) keeps gradient accumulation exact."""

    def __init__(self, group) -> None:
        self.group = group
        self.pending: dict[int, tuple[Any, torch.Tensor]] = {}
        self.queued = False

    def add(self, param, grad: torch.Tensor) -> None:
        if not self.queued:
            Variable._execution_engine.queue_callback(self.flush)
            self.queued = True
        seen = self.pending.get(id(param))
        self.pending[id(param)] = (param, grad if seen is None else seen[1] + grad)

    def flush(self) -> None:
        items, self.pending, self.queued = list(self.pending.values()), {}, False
        by_dtype: dict[torch.dtype, list] = defaultdict(list)
        for param, grad in items:
            by_dtype[grad.dtype].append((param, grad))
        with torch.no_grad():
            for entries in by_dtype.values():
                flat = torch.cat([g.reshape(-1) for _, g in entries])
                where = f"partial gradients ({len(entries)} tensors)"
                all_reduce_(flat, self.group, what=label("all_reduce", where, backward=True))
                record("all_reduce", _nbytes(flat), "backward", where)
                offset = 0
                for param, grad in entries:
                    _accumulate(param, flat[offset : offset + grad.numel()].view_as(grad))
                    offset += grad.numel()


def _accumulate(param, grad: torch.Tensor) -> None:
    if param.grad is None:
        local = grad.clone()
        param.grad = DTensor.from_local(local, param.device_mesh, param.placements) if isinstance(param, DTensor) else local
    else:
        target = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        target.add_(grad)
