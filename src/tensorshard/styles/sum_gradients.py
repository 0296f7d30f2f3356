"""SumGradients: keep a module whole, and sum its own parameters' gradients over the devices in backward.

For a small module that each device runs on its own share of split activations: a per-head norm such as
Qwen3's ``q_norm`` / ``k_norm`` (over head_dim) inside attention split by heads. Its forward is exact on
every device, but each copy of its weight sees only its device's heads, so its gradient is partial. The
module's parameters pass through ``copy_to_parallel`` (forward: identity; backward: all-reduce), so every
copy receives the whole gradient and the copies stay identical; transformers calls this
"replicated_with_grad_allreduce". Cost: one small all-reduce per parameter per use in backward.

Using it on a module that runs on replicated activations would multiply its gradients by the device count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .style import ShardContext, Splits, Style, original_forward, register, wrap_forward


@register("sum_gradients")
@dataclass(frozen=True, kw_only=True)
class SumGradients(Style):
    """Keep this module whole on every device; all-reduce the gradients of its own parameters in backward."""

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
