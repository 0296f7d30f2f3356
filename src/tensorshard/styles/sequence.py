"""Sequence parallelism: between tensor-parallel regions, activations stay split along the sequence.

Without it, the norms (and dropout) of a block run on the whole sequence on every device and each block
costs two all-reduces each way. With it (Megatron-LM's sequence parallelism), the residual stream is
split along the sequence, norms run on sequence shards, and each all-reduce becomes a reduce-scatter
(leaving a row-parallel layer) plus an all-gather (entering the column-parallel layers): the same bytes on
the wire, activation memory of norms and residuals divided by the number of devices.

    "model.layers.0":                      SequenceParallel(input="whole"),      # split the stream once
    "model.layers.*.input_layernorm":      SequenceParallel(output="gathered"),  # norm on shards, then gather
    "model.layers.*.self_attn.o_proj":     RowwiseToSequence(blocks=("q",)),     # reduce-scatter
    "model.layers.*.post_attention_layernorm": SequenceParallel(output="gathered"),
    "model.layers.*.mlp.down_proj":        RowwiseToSequence(),
    "model.norm":                          SequenceParallel(output="gathered"),  # whole again for the head

The gathered output of a norm must feed column-parallel layers only (their `copy_to_parallel` claims it,
so its backward is a reduce-scatter of their partial gradients). The parameters of a sequence-parallel
module see only their shard's tokens: their gradients are partial sums, reduced once per backward pass
in one bucket. The sequence length must be a multiple of the number of devices. Dropout inside a
sequence-parallel module draws the same mask pattern on every shard. Only the torchrun engine implements
these collectives; the in-process engine refuses these styles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from ..partition import block_partition
from .style import ShardContext, Splits, Style, check_choices, register, wrap_forward
from .row import RowwiseParallel


@register("sequence")
@dataclass(frozen=True, kw_only=True)
class SequenceParallel(Style):
    """Run this module (a norm, dropout, a whole decoder layer) on sequence shards.

    Args:
        dim: the sequence dimension of the activations (1 for (batch, seq, features)).
        input: ``"sharded"``: the first argument arrives split along `dim` (the default, between blocks);
            ``"whole"``: it arrives whole and this device keeps its slice (no communication forward).
        output: ``"sharded"``: returned as computed; ``"gathered"``: all-gathered along `dim`, for the
            column-parallel layers that read it.
    """

    torchrun_only: ClassVar[bool] = True

    dim: int = 1
    input: Literal["sharded", "whole"] = "sharded"
    output: Literal["sharded", "gathered"] = "sharded"

    def __post_init__(self) -> None:
        check_choices(self, "input", "output")

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        return {}  # parameters stay whole on every device

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        comm, name, dim = ctx.comm, ctx.name, self.dim
        own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if own:
            comm.partial_grads(module, own, where=name)  # each device saw its own tokens only
        if self.input == "sharded" and self.output == "sharded":
            return
        inner = module.forward

        def forward(x: torch.Tensor, *args, **kwargs):
            if self.input == "whole":
                d = dim % x.dim()
                if x.shape[d] % ctx.world_size:
                    raise ValueError(
                        f"{name}: sequence parallelism splits dimension {d} (length {x.shape[d]}) over "
                        f"{ctx.world_size} devices; pad the sequence to a multiple of {ctx.world_size}"
                    )
                x = comm.split(x, d, block_partition(x.shape[d], ctx.world_size), where=name)
            y = inner(x, *args, **kwargs)
            if self.output == "gathered":
                y = comm.gather_sequence(y, dim, where=name)
            return y

        wrap_forward(module, forward)


class _ScatterInsteadOfReduce:
    """The comm of a row-parallel layer whose partial output goes to sequence shards: all_reduce becomes
    reduce_scatter along the sequence; every other collective is the engine's own."""

    def __init__(self, comm, dim: int) -> None:
        self._comm, self._dim = comm, dim

    def all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        return self._comm.reduce_scatter(x, self._dim, where=where)

    def __getattr__(self, name):
        return getattr(self._comm, name)


@register("rowwise_to_sequence")
@dataclass(frozen=True, kw_only=True)
class RowwiseToSequence(RowwiseParallel):
    """RowwiseParallel whose partial outputs are reduce-scattered to sequence shards (not all-reduced).

    Args:
        blocks: as for RowwiseParallel.
        sequence_dim: the sequence dimension of the output (1 for (batch, seq, features)).
    """

    torchrun_only: ClassVar[bool] = True

    sequence_dim: int = 1

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        super().attach(module, splits, dataclasses.replace(ctx, comm=_ScatterInsteadOfReduce(ctx.comm, self.sequence_dim)))
