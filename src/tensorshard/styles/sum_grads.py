"""SumGrads: keep a module whole, and sum its parameters' gradients over devices in backward.

A small module whose parameters are read by split computations, such as a per-head norm (``q_norm``,
``k_norm``) inside split attention, runs on every device, but each device applies it to its own heads
only, so each copy of its weight receives only part of the gradient. SumGrads passes the module's own
parameters through ``copy_to_parallel`` (forward: identity; backward: all-reduce), so every copy gets the
whole gradient and the copies stay identical. Cost: one small all-reduce per parameter per backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base import ShardContext, Splits, Style, original_forward, register, wrap_forward


@register("sum_grads")
@dataclass(frozen=True, kw_only=True)
class SumGrads(Style):
    """Keep this module whole; all-reduce the gradients of its own parameters in backward."""

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        run = original_forward(module)
        comm, name = ctx.comm, ctx.name

        def forward(*args, **kwargs):
            own = {k: p for k, p in module._parameters.items() if p is not None and p.requires_grad}
            if not own or not torch.is_grad_enabled():
                return run(*args, **kwargs)
            module._parameters.update({k: comm.copy_to_parallel(p, where=f"{name}.{k}") for k, p in own.items()})
            try:
                return run(*args, **kwargs)
            finally:
                module._parameters.update(own)

        wrap_forward(module, forward)
