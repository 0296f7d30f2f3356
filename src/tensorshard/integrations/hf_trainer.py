"""transformers.Trainer under torchrun: a model split by the torchrun engine is one that owns its placement and
gradient reduction, as the Trainer is told by the model's `is_distributed_loading_by_transformers`.

The Trainer reads that flag from the model it is given (transformers' own `from_pretrained(distributed_config=
...)` sets it on the models it shards); with it, the Trainer neither moves the model nor lets accelerate wrap it in
DistributedDataParallel across the ranks (which refuses DTensor parameters, and would average gradients over
ranks that hold different slices), and still has accelerate compile it when `torch_compile=True`. The
collectives of forward and backward are the engine's own, so nothing more is needed for the tensor-parallel
group. Only a model whose tensor-parallel group is the whole world is marked: with data-parallel ranks beside it
(a 2-D mesh), nothing would average their gradients unless FSDP2 shards over them, which happens after the
split, so such a model stays unmarked and DDP refuses it naming the fix (engines/torchrun/ddp_refusal.py).
A transformers model has the flag as a read-only property over `_is_distributed_loading_by_transformers`;
any other module gets the attribute itself.

The flag also makes the Trainer refuse to checkpoint optimizer state (`save_only_model=True` or
`save_strategy="no"`), and it does not make the Trainer's sampler give every rank of a tensor-parallel group the
same batch: docs/finetuning.md shows both (the split model's input check names the sampler fix).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..plans.slices import after_split, split_layout

FLAG = "is_distributed_loading_by_transformers"


@after_split
def _mark(root: nn.Module) -> None:
    """Mark a model split over 2+ ranks of a torchrun mesh as owning its placement and gradient reduction."""
    layout = split_layout(root)
    if layout is None or layout.engine != "torchrun" or layout.state.comm.world_size == 1:
        return
    if layout.state.comm.world_size != dist.get_world_size():
        return  # data-parallel ranks beside the group: see the module docstring
    if isinstance(getattr(type(root), FLAG, None), property):
        root._is_distributed_loading_by_transformers = True
    else:
        setattr(root, FLAG, True)
