"""Row-parallel: each device multiplies its slice of the input features; partial outputs are summed.

    y = x @ W.T + b          W: (out, in) split by columns (input features)
    device r:  p_r = x_r @ W_r.T      y = all_reduce(sum_r p_r) + b

One all-reduce in forward, none in backward (dL/dy is already whole on every device, and dL/dx_r is
exactly this device's slice). The bias is replicated and added once, after the sum, not once per device.
A column-parallel layer before it hands over its output still split, so a column -> row pair costs one
all-reduce each way. An input that arrives whole is split locally (its gradient is gathered in backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..layers import CONV, CONV1D_HF, LINEAR, require_kind, shape_along, weight_shape
from ..partition import block_partition
from .style import ShardContext, Splits, Style, feature_dim, register, wrap_forward


@register("rowwise")
@dataclass(frozen=True, kw_only=True)
class RowwiseParallel(Style):
    """Split a Linear / Conv1D / Conv layer by input features; the output is summed over devices.

    Args:
        blocks: layout of the input features, as for ColwiseParallel (``("q",)`` for an attention
            output projection reading the heads of the enclosing ``Heads`` entry).
    """

    blocks: tuple[int | str, ...] | None = None

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        kind = require_kind(module, "RowwiseParallel", ctx.name, (LINEAR, CONV1D_HF, CONV))
        size = weight_shape(module)[kind.weight_in_dim]
        part = block_partition(size, ctx.world_size, self.blocks, ctx.heads, where=ctx.name, plain_sizes=ctx.plain_sizes)
        if part.overlapping:
            raise NotImplementedError(
                f"{ctx.name}: a row-parallel layer cannot read replicated KV heads; split it by 'q' heads"
            )
        return {"weight": (kind.weight_in_dim, part)}

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        kind = require_kind(module, "RowwiseParallel", ctx.name, (LINEAR, CONV1D_HF, CONV))
        _, part = splits["weight"]
        local = part.local_size(ctx.rank)
        setattr(module, kind.in_attr, local)
        comm, name = ctx.comm, ctx.name

        def forward(x: torch.Tensor, *, add_before_reduce=None, before_matmul=None) -> torch.Tensor:
            # Hooks for an adapter wrapped around this layer (integrations/peft/lora_styles.py, ia3_styles.py),
            # both given this device's input slice: before_matmul(x_r) rescales it (IA3); add_before_reduce is
            # another partial sum of the same output (LoRA's, DoRA's), or a function of x_r returning one, summed
            # over the devices in the same all-reduce.
            fdim = feature_dim(kind.feature_dim, x)
            if x.shape[fdim] != local:
                if x.shape[fdim] != part.size:
                    raise ValueError(
                        f"{name}: expected {local} input features on device {ctx.rank} (its slice of "
                        f"{part.size}) or all {part.size}, got input of shape {tuple(x.shape)}. The layer "
                        "before it is probably split differently; check the plan's blocks."
                    )
                x = comm.split(x, fdim, part, where=name)  # a whole input: keep this device's slice
            if before_matmul is not None:
                x = before_matmul(x)
            y = kind.matmul(module, x, module.weight)
            if callable(add_before_reduce):
                add_before_reduce = add_before_reduce(x)
            if add_before_reduce is not None:
                y = y + add_before_reduce.to(y.dtype)
            y = comm.all_reduce(y, where=name)
            if module.bias is not None:
                y = y + shape_along(kind, y, module.bias)
            return y

        fdim_of = kind.feature_dim  # (an index from either end: x.shape[fdim_of] is the feature count)
        linear = kind is LINEAR

        def no_grad(x: torch.Tensor, **kwargs) -> torch.Tensor:
            # `forward` while dynamo traces without gradients, an adapter's hooks, or a whole input to split
            if kwargs or torch.is_grad_enabled() or not torch.compiler.is_compiling() or x.shape[fdim_of] != local:
                return forward(x, **kwargs)
            w = module.weight
            # (a plain weight: what kind.matmul does for it, quant.weight_kind said no packed weight)
            y = F.linear(x, w) if linear and (type(w) is nn.Parameter or type(w) is torch.Tensor) else kind.matmul(module, x, w)
            y = comm.compiling_all_reduce(y, where=name)
            if module.bias is not None:
                y = y + shape_along(kind, y, module.bias)
            return y

        wrap_forward(module, forward, no_grad)
