"""Embedding tables split along the vocabulary or along the embedding dimension.

``split="vocab"``: device r holds rows [start_r, stop_r). Ids outside its range are looked up as row 0
and their vectors zeroed, then the partial results are summed (one all-reduce in forward; the gradient of
each row lands on the one device that holds it). Memory for a large vocabulary falls as 1/N.

``split="embedding"``: device r holds a slice of the columns of every row; the slices are concatenated
(one all-gather in forward). Works for every EmbeddingBag mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import EMBEDDING, require_kind
from ..partition import block_partition
from .style import ShardContext, Splits, Style, check_choices, original_forward, register, wrap_forward


@register("embedding")
@dataclass(frozen=True, kw_only=True)
class EmbeddingParallel(Style):
    """Split an nn.Embedding / nn.EmbeddingBag.

    Args:
        split: ``"vocab"`` (rows, masked lookup + all-reduce) or ``"embedding"`` (columns, all-gather).
    """

    split: Literal["vocab", "embedding"] = "vocab"

    def __post_init__(self) -> None:
        check_choices(self, "split")

    def shard(self, module: nn.Module, ctx: ShardContext) -> Splits:
        require_kind(module, "EmbeddingParallel", ctx.name, (EMBEDDING,))
        if module.max_norm is not None:
            raise NotImplementedError(
                f"{ctx.name}: embeddings with max_norm renormalise whole rows and cannot be split; replicate it"
            )
        dim = 0 if self.split == "vocab" else 1
        if self.split == "vocab":
            if getattr(module, "scale_grad_by_freq", False):
                raise NotImplementedError(f"{ctx.name}: scale_grad_by_freq needs the whole vocabulary; use split='embedding'")
            if isinstance(module, nn.EmbeddingBag) and (module.mode == "max" or module.padding_idx is not None):
                raise NotImplementedError(
                    f"{ctx.name}: EmbeddingBag(mode={module.mode!r}, padding_idx={module.padding_idx}) cannot be "
                    "split by vocabulary; use EmbeddingParallel(split='embedding')"
                )
        part = block_partition(module.weight.shape[dim], ctx.world_size, None, None, where=ctx.name)
        return {"weight": (dim, part)}

    def attach(self, module: nn.Module, splits: Splits, ctx: ShardContext) -> None:
        dim, part = splits["weight"]
        comm, name = ctx.comm, ctx.name
        if dim == 1:
            module.embedding_dim = part.local_size(ctx.rank)
            run = original_forward(module)

            def forward_columns(*args, **kwargs) -> torch.Tensor:
                y = run(*args, **kwargs)
                return comm.all_gather(y, y.dim() - 1, part, where=name)

            wrap_forward(module, forward_columns)
            return

        ((start, stop),) = part.ranges[ctx.rank]
        module.num_embeddings = stop - start
        if module.padding_idx is not None:
            module.padding_idx = module.padding_idx - start if start <= module.padding_idx < stop else None
        bag = isinstance(module, nn.EmbeddingBag)
        # A subclass's own forward (Gemma, BART, ... scale the rows) runs on this device's rows; the rows of ids
        # held by other devices are zeroed after it, so any forward that maps each id's row on its own is exact.
        run = original_forward(module)

        def forward_rows(ids: torch.Tensor, offsets=None, per_sample_weights=None) -> torch.Tensor:
            outside = (ids < start) | (ids >= stop)
            local = (ids - start).masked_fill(outside, 0)
            if not bag:
                y = run(local)
                y = y.masked_fill(outside.unsqueeze(-1), 0.0)
            else:
                # Bags mix ids from several devices: sum the rows this device holds (weight 0 elsewhere),
                # and for mode="mean" divide by the whole bag's size, not the local count.
                keep = (~outside).to(module.weight.dtype)
                weights = keep if per_sample_weights is None else per_sample_weights * keep
                y = F.embedding_bag(
                    local, module.weight, offsets, None, 2.0, False, "sum", module.sparse, weights,
                    module.include_last_offset, None,
                )
                if module.mode == "mean":
                    y = y / _bag_sizes(ids, offsets, module.include_last_offset, y).clamp(min=1).unsqueeze(-1)
            return comm.all_reduce(y, where=name)

        wrap_forward(module, forward_rows)


def _bag_sizes(ids: torch.Tensor, offsets, include_last_offset: bool, like: torch.Tensor) -> torch.Tensor:
    if ids.dim() == 2:
        return torch.full((ids.shape[0],), ids.shape[1], dtype=like.dtype, device=like.device)
    ends = offsets[1:] if include_last_offset else torch.cat([offsets[1:], offsets.new_tensor([ids.numel()])])
    starts = offsets[:-1] if include_last_offset else offsets
    return (ends - starts).to(like.dtype)
