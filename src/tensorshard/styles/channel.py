"""Channel-parallel: a layer that works on each channel alone, run on the channels a device already holds.

Between a column-parallel convolution (output channels split) and the row-parallel one that consumes
them, a ConvNet applies layers that never mix channels:

    BatchNorm:            y[:, c] = (x[:, c] - mean_c) / sqrt(var_c + eps) * weight[c] + bias[c]
    depthwise conv:       y[:, c] = conv(x[:, c], weight[c])          (groups = in = out channels)
    GroupNorm:            like BatchNorm, with mean and variance over each group of C / G channels

so device r, holding channels C_r of x, computes exactly channels C_r of y from its slice of the
per-channel parameters and buffers (weight, bias, running_mean, running_var) and nothing else. A
GroupNorm's groups must stay whole on one device: plan inference makes each group one unit (like an
attention head), so the channels split on group boundaries and each device normalises its own groups. In train
mode BatchNorm's batch statistics are per channel too, and so is the running-statistics update: training
is exact. No communication forward or backward; each parameter's gradient lives on its one device.

The channels split exactly like the column that produced them (same blocks, same heads), so the slices
line up: plan inference gives the style the same block layout it gives that column.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..partition import block_partition
from .base import ShardContext, Splits, Style, register

_BATCH_NORMS = (nn.modules.batchnorm._BatchNorm,)  # BatchNorm1d/2d/3d, SyncBatchNorm, Lazy variants
_GROUP_NORMS = (nn.GroupNorm,)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def is_channelwise(module: nn.Module) -> bool:
    """A layer that mixes channels at most within fixed groups: BatchNorm, GroupNorm, or a depthwise
    convolution (groups = in = out channels, zero padding)."""
    if isinstance(module, _BATCH_NORMS + _GROUP_NORMS):
        return True
    return (
        isinstance(module, _CONVS) and module.groups > 1 and module.groups == module.in_channels == module.out_channels
        and module.padding_mode == "zeros"
    )


def channel_count(module: nn.Module) -> int:
    if isinstance(module, _GROUP_NORMS):
        return module.num_channels
    return module.num_features if isinstance(module, _BATCH_NORMS) else module.out_channels


def channel_group(module: nn.Module) -> int:
    """Channels that must stay together on one device: a GroupNorm's group, else 1."""
    return module.num_channels // module.num_groups if isinstance(module, _GROUP_NORMS) else 1


@register("channel")
@dataclass(frozen=True, kw_only=True)
class ChannelParallel(Style):
    """Split a BatchNorm, a GroupNorm (on group boundaries) or a depthwise convolution by channels; its input
    arrives split by channels (from a column-parallel layer) and its output stays split.

    Args:
        blocks: the layout of the channels, as the producing column's ``blocks`` (default: one block).
    """

    blocks: tuple[int | str, ...] | None = None

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        if not is_channelwise(module):
            raise NotImplementedError(
                f"ChannelParallel cannot split {ctx.name} ({type(module).__name__}): it applies to BatchNorm, GroupNorm "
                "and depthwise convolutions (groups == in_channels == out_channels). Use Replicate() for this module."
            )
        part = block_partition(channel_count(module), ctx.world_size, self.blocks, ctx.heads, where=ctx.name)
        if part.overlapping:
            raise NotImplementedError(f"{ctx.name}: ChannelParallel cannot follow KV heads replicated over devices")
        group = channel_group(module)
        sizes = [part.local_size(r) for r in range(ctx.world_size)]
        if any(size % group for size in sizes):
            raise ValueError(
                f"{ctx.name}: GroupNorm groups of {group} channels would be cut ({sizes} channels per device); "
                "split its channels on group boundaries (the producing column's blocks) or replicate it"
            )
        splits: Splits = {}
        for name in ("weight", "bias", "running_mean", "running_var"):
            tensor = getattr(module, name, None)
            if tensor is not None:
                splits[name] = (0, part)  # per channel: BatchNorm (C,), depthwise conv weight (C, 1, *kernel)
        return splits

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        part = next(iter(splits.values()))[1] if splits else block_partition(
            channel_count(module), ctx.world_size, self.blocks, ctx.heads, where=ctx.name)
        local = part.local_size(ctx.rank)
        if isinstance(module, _GROUP_NORMS):
            module.num_groups, module.num_channels = local // channel_group(module), local
        elif isinstance(module, _BATCH_NORMS):
            module.num_features = local
        else:  # a depthwise convolution: one group per local channel
            module.in_channels = module.out_channels = module.groups = local
