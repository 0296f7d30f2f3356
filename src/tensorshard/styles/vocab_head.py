"""VocabParallelHead: the output layer split by vocabulary, its logits left split (loss parallelism).

    "lm_head": VocabParallelHead()
    ...
    logits = model(input_ids).logits                 # a DTensor: Shard(-1) over the tensor-parallel mesh
    loss = tp.vocab_parallel_cross_entropy(logits[:, :-1], labels[:, 1:])

A column-parallel output head with `gather_output=True` all-gathers (batch x sequence x vocabulary) logits
on every device, the largest activation of a language model. This head keeps each device's vocabulary
slice and returns the logits as one DTensor that knows its split; `tensorshard.vocab_parallel_cross_entropy`
(or torch's own `loss_parallel()` context) computes the loss from the slices with all-reduces of
(batch x sequence) numbers only. The vocabulary is split like `torch.chunk` (ceil(V / N) rows per device),
the layout DTensor's `Shard` describes. Only the torchrun engine can hand out DTensors; the in-process
engine refuses this style.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..comm.dtensor import chunk_partition
from ..layers import CONV1D_HF, LINEAR, require_kind
from .style import ShardContext, Splits, feature_dim, register, wrap_forward
from .column import ColwiseParallel


@register("vocab_head")
@dataclass(frozen=True, kw_only=True)
class VocabParallelHead(ColwiseParallel):
    """Split a Linear / Conv1D output head by vocabulary and return its logits as a vocabulary-sharded
    DTensor (no gather). Takes no options: the vocabulary is one plain block, split like torch.chunk."""

    torchrun_only: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.gather_output or self.blocks:
            raise ValueError("VocabParallelHead splits one vocabulary and never gathers; it takes no gather_output/blocks")

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        kind = require_kind(module, "VocabParallelHead", ctx.name, (LINEAR, CONV1D_HF))
        part = chunk_partition(module.weight.shape[kind.weight_out_dim], ctx.world_size)
        splits = {"weight": (kind.weight_out_dim, part)}
        if getattr(module, "bias", None) is not None:
            splits["bias"] = (0, part)
        return splits

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        super().attach(module, splits, ctx)  # column-parallel forward: (..., V / N) logits per device
        kind = require_kind(module, "VocabParallelHead", ctx.name, (LINEAR, CONV1D_HF))
        _, part = splits["weight"]
        comm, name, inner = ctx.comm, ctx.name, module.forward

        def forward(x: torch.Tensor, *args, **kwargs):
            y = inner(x, *args, **kwargs)
            return comm.as_sharded(y, feature_dim(kind.feature_dim, y), part, where=name)

        wrap_forward(module, forward)
