"""Channel-parallel: a layer that works on each channel alone, run on the channels a device already holds.

Between a column-parallel convolution (output channels split) and the row-parallel one that consumes
them, a ConvNet applies layers that never mix channels:

    BatchNorm:            y[:, c] = (x[:, c] - mean_c) / sqrt(var_c + eps) * weight[c] + bias[c]
    depthwise conv:       y[:, c] = conv(x[:, c], weight[c])          (groups = in = out channels)
    GroupNorm:            like BatchNorm, with mean and variance over each group of C / G channels

so device r, holding channels C_r of x, computes exactly channels C_r of y from its slice of the
per-channel parameters and buffers (weight, bias, running_mean, running_var) and nothing else.

A global response norm (ConvNeXt V2's GRN, channels last) needs one number from the other devices:

    G[c] = ||x[:, :, :, c]||_2 over the spatial positions      (per channel: local)
    y    = weight * x * G / (mean_c G + 1e-6) + bias + x        (the mean runs over ALL channels)

so each device sums its own G over its channels, one all-reduce adds the sums (backward: one all-reduce
of their gradients, since every device's channels read the total), and the rest is per channel. A
GroupNorm's groups must stay whole on one device: plan inference makes each group one unit (like an
attention head), so the channels split on group boundaries and each device normalises its own groups. In train
mode BatchNorm's batch statistics are per channel too, and so is the running-statistics update: training
is exact. No communication forward or backward; each parameter's gradient lives on its one device.

The channels split exactly like the column that produced them (same blocks, same heads), so the slices
line up: plan inference gives the style the same block layout it gives that column.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..partition import block_partition
from .style import ShardContext, Splits, Style, register, wrap_forward

_BATCH_NORMS = (nn.modules.batchnorm._BatchNorm,)  # BatchNorm1d/2d/3d, SyncBatchNorm, Lazy variants
_GROUP_NORMS = (nn.GroupNorm,)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def is_channelwise(module: nn.Module) -> bool:
    """A layer that mixes channels at most within fixed groups: BatchNorm, GroupNorm, or a depthwise
    convolution (groups = in = out channels, zero padding); or a global response norm (one all-reduce)."""
    if isinstance(module, _BATCH_NORMS + _GROUP_NORMS) or is_response_norm(module):
        return True
    return (
        isinstance(module, _CONVS) and module.groups > 1 and module.groups == module.in_channels == module.out_channels
        and module.padding_mode == "zeros"
    )


_RESPONSE_NORMS: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()
GRN_EPS = 1e-6


def _grn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Global response normalization, channels last (batch, h, w, c); `mean` of the norms over all channels
    when the caller computed it over more channels than `x` holds."""
    g = torch.linalg.vector_norm(x, ord=2, dim=(1, 2), keepdim=True)  # (b, 1, 1, c)
    mean = g.mean(dim=-1, keepdim=True) if mean is None else mean
    return weight * (x * (g / (mean + GRN_EPS))) + bias + x


def is_response_norm(module: nn.Module) -> bool:
    """A module computing ConvNeXt V2's global response normalization: exactly the parameters weight and
    bias of shape (1, 1, 1, C), no buffers or children, and its forward equals `_grn` on a small random
    probe (so a module shaped alike that computes anything else is not taken for one). Remembered per module."""
    known = _RESPONSE_NORMS.get(module)
    if known is not None:
        return known
    params = dict(module.named_parameters(recurse=False))
    shapes = {p.shape for p in params.values()}
    found = False
    if (set(params) == {"weight", "bias"} and len(shapes) == 1 and not list(module.children())
            and not list(module.buffers(recurse=False))):
        shape = next(iter(shapes))
        weight = params["weight"]
        if len(shape) == 4 and shape[:3] == (1, 1, 1) and weight.is_floating_point() and not weight.is_meta:
            found = _probe(module, shape[-1], weight)
    _RESPONSE_NORMS[module] = found
    return found


def _probe(module: nn.Module, channels: int, weight: torch.Tensor) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 3, channels, generator=gen).to(weight.device, weight.dtype)
    w = torch.randn(1, 1, 1, channels, generator=gen).to(weight.device, weight.dtype)
    b = torch.randn(1, 1, 1, channels, generator=gen).to(weight.device, weight.dtype)
    probe = type(module).__new__(type(module))
    nn.Module.__init__(probe)
    probe.weight, probe.bias = nn.Parameter(w, requires_grad=False), nn.Parameter(b, requires_grad=False)
    try:
        with torch.no_grad():
            got = type(module).forward(probe, x)  # the class's forward, no hooks, the module untouched
    except Exception:
        return False
    want = _grn(x, w, b)
    return isinstance(got, torch.Tensor) and got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))


def channel_dim(module: nn.Module) -> int:
    """The dimension of the module's input that holds its channels: last for a response norm, else 1."""
    return -1 if is_response_norm(module) else 1


def channel_count(module: nn.Module) -> int:
    if isinstance(module, _GROUP_NORMS):
        return module.num_channels
    if is_response_norm(module):
        return module.weight.shape[-1]
    return module.num_features if isinstance(module, _BATCH_NORMS) else module.out_channels


def channel_group(module: nn.Module) -> int:
    """Channels that must stay together on one device: a GroupNorm's group, else 1."""
    return module.num_channels // module.num_groups if isinstance(module, _GROUP_NORMS) else 1


@register("channel")
@dataclass(frozen=True, kw_only=True)
class ChannelParallel(Style):
    """Split a BatchNorm, a GroupNorm (on group boundaries), a depthwise convolution or a global response
    norm (one all-reduce) by channels; its input arrives split by channels (from a column-parallel layer)
    and its output stays split.

    Args:
        blocks: the layout of the channels, as the producing column's ``blocks`` (default: one block).
    """

    blocks: tuple[int | str, ...] | None = None

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        if not is_channelwise(module):
            raise NotImplementedError(
                f"ChannelParallel cannot split {ctx.name} ({type(module).__name__}): it applies to BatchNorm, GroupNorm, "
                "depthwise convolutions (groups == in_channels == out_channels) and global response norms (ConvNeXt V2). "
                "Use Replicate() for this module."
            )
        part = block_partition(channel_count(module), ctx.world_size, self.blocks, ctx.heads, where=ctx.name, plain_sizes=ctx.plain_sizes)
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
        if is_response_norm(module):
            return {"weight": (3, part), "bias": (3, part)}  # (1, 1, 1, C)
        for name in ("weight", "bias", "running_mean", "running_var"):
            tensor = getattr(module, name, None)
            if tensor is not None:
                splits[name] = (0, part)  # per channel: BatchNorm (C,), depthwise conv weight (C, 1, *kernel)
        return splits

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        part = next(iter(splits.values()))[1] if splits else block_partition(
            channel_count(module), ctx.world_size, self.blocks, ctx.heads, where=ctx.name, plain_sizes=ctx.plain_sizes)
        local = part.local_size(ctx.rank)
        if isinstance(module, _GROUP_NORMS):
            module.num_groups, module.num_channels = local // channel_group(module), local
        elif isinstance(module, _BATCH_NORMS):
            module.num_features = local
        elif is_response_norm(module):
            _attach_response_norm(module, part.size, ctx)
        else:  # a depthwise convolution: one group per local channel
            module.in_channels = module.out_channels = module.groups = local


def _attach_response_norm(module: nn.Module, total: int, ctx: ShardContext) -> None:
    """The mean of the per-channel norms over all `total` channels: each device's sum, all-reduced."""
    comm, name = ctx.comm, ctx.name

    def forward(x: torch.Tensor) -> torch.Tensor:  # (b, h, w, local channels)
        g = torch.linalg.vector_norm(x, ord=2, dim=(1, 2), keepdim=True)
        # all_reduce sums forward (gradient passed through); copy_to_parallel sums the gradients backward
        mean = comm.copy_to_parallel(comm.all_reduce(g.sum(dim=-1, keepdim=True), where=name), where=name) / total
        return _grn(x, module.weight, module.bias, mean)

    wrap_forward(module, forward)
