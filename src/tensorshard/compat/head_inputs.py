"""An input rule for a tensor that holds something per attention head (BLOOM's ALiBi bias): `SliceHeads`.

The tensor_parallel package's BLOOM config sliced the ALiBi bias, built outside the attention for every head,
with an input rule (``{"alibi": split_alibi}``) so each device kept its heads' rows. tensorshard's BLOOM preset
does the same with ``AttentionHeads(head_inputs={"alibi": "batch*heads"})``; `SliceHeads` is that entry written
as a rule: compat/presets.py puts it in the Config, translate.py turns it back into the AttentionHeads entry,
and called as the original called its input rules (``rule(tensor, rank=r)``) it returns device r's slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..partition import HeadGroups
from ..styles.attention_heads import LAYOUTS


@dataclass(frozen=True)
class SliceHeads:
    """Keep each device's heads of a per-head input.

    Args:
        layout: how the heads sit in the tensor's first dimension: "batch*heads" (batch-major, ALiBi's
            (batch * heads, 1, keys)) or "heads".
        num_heads: the attention's query heads (the whole model's).
        world_size: the devices the heads are spread over (as the Heads entry spreads them).
    """

    layout: str
    num_heads: int
    world_size: int

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"SliceHeads layout {self.layout!r}: use one of {LAYOUTS}")

    def __call__(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        start, stop = HeadGroups.build(self.num_heads, self.num_heads, self.world_size).q[rank]
        if self.layout == "heads":
            return tensor[start:stop]
        per_batch = tensor.view(-1, self.num_heads, *tensor.shape[1:])  # (batch, heads, ...)
        return per_batch[:, start:stop].reshape(-1, *tensor.shape[1:])
