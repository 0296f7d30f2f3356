"""`model_layout(model)`: the ModelLayout of any model the checkpoint code reads or writes.

The engine that split the model says where each tensor lives (`tensorshard.plans.slices.split_layout`);
this module picks the matching view: torchrun.py's `TorchrunLayout` (this process's rank of a module split
by `parallelize`) or layout.py's `ModelLayout` (a TensorParallel, every rank in this process; or a plain
module, one rank). No engine is imported.
"""

from __future__ import annotations

from torch import nn

from .layout import ModelLayout, inprocess_layout
from .torchrun import is_parallelized, torchrun_layout


def model_layout(model: nn.Module) -> ModelLayout:
    """The layout of a TensorParallel model, of a model split by `parallelize` under torchrun (this
    process's rank), or of a plain module (one rank, every tensor whole)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module; got {type(model).__name__}")
    if is_parallelized(model):
        return torchrun_layout(model)
    if any(hasattr(p, "to_local") for p in model.parameters()):
        raise NotImplementedError(
            f"this {type(model).__name__} holds DTensors that tensorshard.parallelize did not make (torch's "
            "parallelize_module or fully_shard alone?); save and load it with torch.distributed.checkpoint, "
            "whose folders tp.load_sharded reads. See docs/checkpoints.md."
        )
    return inprocess_layout(model)
