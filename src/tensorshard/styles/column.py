"""Column-parallel: each device computes a slice of the output features from the whole input.

    y = x @ W.T + b          W: (out, in) split by rows (output features), b split alike
    device r:  y_r = x @ W_r.T + b_r        x replicated, y_r split along the feature dim

No communication in forward. In backward each device holds only its part of dL/dx, so the replicated
input goes through `copy_to_parallel`: one all-reduce of dL/dx, shared by every column layer that reads
the same tensor (q, k and v; gate and up). With `gather_output=True` the slices are concatenated
(all-gather) so the output is whole on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import quant
from ..layers import CONV, CONV1D_HF, LINEAR, require_kind, weight_shape
from ..partition import block_partition, kv_local_ranges
from .style import ShardContext, Splits, Style, feature_dim, original_forward, register, wrap_forward


@register("colwise")
@dataclass(frozen=True, kw_only=True)
class ColwiseParallel(Style):
    """Split a Linear / Conv1D / Conv layer by output features.

    Args:
        gather_output: concatenate the slices so the output is whole on every device (all-gather).
            Leave False when a row-parallel layer consumes the output.
        blocks: the layout of the output features when the weight fuses several matrices or holds heads:
            ints for plain blocks (gate|up: ``(11008, 11008)``), ``"q"`` / ``"kv"`` for query / key-value
            heads of the enclosing ``Heads`` entry, ``"q*3"`` for a q|k|v triple per head. Each block is
            split on its own, on unit boundaries. Default: one plain block.
    """

    gather_output: bool = False
    blocks: tuple[int | str, ...] | None = None

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        kind = require_kind(module, "ColwiseParallel", ctx.name, (LINEAR, CONV1D_HF, CONV))
        size = weight_shape(module)[kind.weight_out_dim]
        part = block_partition(size, ctx.world_size, self.blocks, ctx.heads, where=ctx.name, plain_sizes=ctx.plain_sizes)
        if part.overlapping and self.gather_output:
            raise NotImplementedError(
                f"{ctx.name}: gather_output=True with KV heads replicated over devices is not supported; "
                "use at most as many devices as KV heads, or gather_output=False"
            )
        splits = {"weight": (kind.weight_out_dim, part)}
        if getattr(module, "bias", None) is not None:
            splits["bias"] = (0, part)
        return splits

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        kind = require_kind(module, "ColwiseParallel", ctx.name, (LINEAR, CONV1D_HF, CONV))
        dim, part = splits["weight"]
        setattr(module, kind.out_attr, part.local_size(ctx.rank))
        comm, name = ctx.comm, ctx.name
        run = original_forward(module)

        # Replicated KV heads (fewer KV heads than devices): the devices holding the same KV head each see
        # the gradient of their own query heads only; `tie` sums it over them in backward.
        tied = []
        if part.overlapping:
            tied = kv_local_ranges(part.size, ctx.world_size, self.blocks or (), ctx.heads, ctx.rank, ctx.plain_sizes)
            groups = ctx.heads.kv_sharers()

        def local(t: torch.Tensor, tdim: int) -> torch.Tensor:
            return tie_ranges(t, tdim, tied, comm, groups, name)

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            x = comm.copy_to_parallel(x, where=name)
            if tied and torch.is_grad_enabled():
                # A quantized weight is frozen: only its bias needs tying.
                weight = module.weight if quant.weight_kind(module.weight) else local(module.weight, dim)
                y = kind.matmul(module, x, weight)
                if module.bias is not None:
                    bias = local(module.bias, 0)
                    y = y + (bias if kind.feature_dim == -1 else bias.view(-1, *([1] * (y.dim() - 2))))
            else:
                y = run(x, *args, **kwargs)
            if self.gather_output:
                y = comm.all_gather(y, feature_dim(kind.feature_dim, y), part, where=name)
            return y

        # without gradients copy_to_parallel is the identity and no range is tied: the forward is the layer's own
        wrap_forward(module, forward, None if self.gather_output else run)


def tie_ranges(t: torch.Tensor, tdim: int, tied, comm, groups, where: str) -> torch.Tensor:
    """`t` with its index ranges `tied` along `tdim` (replicated KV heads) passed through `comm.tie`: their
    gradient is summed over the devices holding the same head."""
    pieces, offset = [], 0
    for start, stop in tied:
        if start > offset:
            pieces.append(t.narrow(tdim, offset, start - offset))
        pieces.append(comm.tie(t.narrow(tdim, start, stop - start), groups, where=where))
        offset = stop
    if offset < t.shape[tdim]:
        pieces.append(t.narrow(tdim, offset, t.shape[tdim] - offset))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, tdim)
