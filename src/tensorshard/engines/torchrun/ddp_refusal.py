"""Refusing DistributedDataParallel around a model split under torchrun, with an error that names the fix.

DDP all-reduces every gradient over its process group, and each rank of a tensor-parallel group holds other
slices: DDP across those ranks is never right, and torch's own failure ("aten.cat.default got mixed
torch.Tensor and DTensor", while broadcasting the parameters) says nothing of why. (transformers.Trainer,
whose accelerate would wrap it so, is told not to: integrations/hf_trainer.py.)

DDP's constructor reads the module's `_ddp_params_and_buffers_to_ignore` (the names it should skip) before
anything else; a split model holds a `RefuseDDP` there, and reading it raises `DDPRefusedError`. Nothing else
reads that attribute from the model (Lightning reads it from the LightningModule, which holds the model).
"""

from __future__ import annotations

from torch import nn


class DDPRefusedError(TypeError):
    """DistributedDataParallel was asked to wrap a model split under torchrun."""


class RefuseDDP:
    """Stands in for the list of names DDP skips; iterating it (DDP's first step) raises DDPRefusedError."""

    def __init__(self, model: str, world: int) -> None:
        self.model, self.world = model, world

    def __iter__(self):
        raise DDPRefusedError(
            f"this {self.model} is split over {self.world} tensor-parallel ranks (tensorshard) and cannot be wrapped "
            "in DistributedDataParallel: DDP would average gradients over ranks that hold different slices. "
            "Train it as it is: its collectives already reduce what the tensor-parallel group shares "
            "(transformers.Trainer recognises such a model and does not wrap it: docs/finetuning.md; Lightning's "
            "ModelParallelStrategy; your own loop, with tp.TensorParallelSampler for the batches). For data "
            "parallelism on top of tensor parallelism, shard over "
            "the data-parallel dimension of a 2-D mesh with FSDP2 (fully_shard(model, mesh=mesh['data_parallel']))."
        )

    def __reduce__(self):
        return (RefuseDDP, (self.model, self.world))


def refuse_ddp(model: nn.Module, world: int) -> None:
    """Make DistributedDataParallel(model) raise DDPRefusedError, naming the fix (module docstring)."""
    model._ddp_params_and_buffers_to_ignore = RefuseDDP(type(model).__name__, world)
