"""A model is split once: splitting a split model, or the original a split consumed, is refused at split time.

`tensor_parallel()` moves the original's weights into the shards and leaves it on the meta device
(inprocess.py). Splitting the result again, or splitting that emptied original again (a re-run notebook
cell), would otherwise fail late and confusingly (an MRO error building the class of a transformers
model, or a first call asking to load weights). Both engines call `refuse_split_twice` before anything
changes; the in-process engine marks what it returns and what it consumed.
"""

from __future__ import annotations

from torch import nn

_SPLIT = "_tensorshard_split"  # on a TensorParallel: "over ['cpu[0]', 'cpu[1]']"
_CONSUMED = "_tensorshard_consumed"  # on an original whose weights moved into a TensorParallel


def mark_split(model: nn.Module, labels: list[str]) -> None:
    model.__dict__[_SPLIT] = f"over {len(labels)} device(s) {labels}"


def mark_consumed(original: nn.Module, labels: list[str]) -> None:
    original.__dict__[_CONSUMED] = f"over {len(labels)} device(s) {labels}"


def unmark_consumed(copy_of_original: nn.Module) -> None:
    """For a copy of a consumed original that is meant to be split again (engines/inprocess/copies.py)."""
    copy_of_original.__dict__.pop(_CONSUMED, None)


def refuse_split_twice(module: nn.Module) -> None:
    """Raise TypeError if `module`, or a submodule, is a split model or the emptied original of one."""
    for name, sub in module.named_modules():
        where = f"{type(module).__name__}.{name}" if name else f"this {type(module).__name__}"
        if _SPLIT in sub.__dict__:
            raise TypeError(
                f"{where} is already split {sub.__dict__[_SPLIT]}: it is a model tensor_parallel() returned. "
                "Split the unsplit model once; to change the devices or the plan, save this one "
                "(tp.save_sharded(model, folder)) and load it at the new count (tp.load_sharded or tp.from_pretrained)."
            )
        if _CONSUMED in sub.__dict__:
            raise TypeError(
                f"{where} was already split {sub.__dict__[_CONSUMED]} by an earlier tensor_parallel() call, which "
                "moved its weights into the model that call returned and left this one empty, on the meta device "
                "(a notebook cell run twice?). Use the split model the first call returned, or build or load the "
                "model again before splitting it."
            )
