"""How many parameters the unsplit model has, counted from its split: each element once.

    split.num_parameters()                 # the unsplit model's count (transformers' method: integrations/)
    split.get_nb_trainable_parameters()    # a split PeftModel's, as PEFT counts the unsplit one

Summing ``p.numel()`` over a split model's parameters (what transformers' ``num_parameters`` and PEFT's
``get_nb_trainable_parameters`` do) counts every device's tensors: a split tensor's slices add up to the whole
tensor, but a parameter the plan leaves whole (a norm, a bias, a frozen parameter ZeRO-3 leaves alone) is
counted once per device, and so are the rows of a KV head repeated on several devices (more devices than KV
heads). Users and the Trainer log that number (and the Trainer's FLOP count multiplies by it), so here each
parameter of the unsplit model counts as many elements as it has there, whatever the devices hold: a tensor
ZeRO-3 partitioned is the sum of its pieces, a replicated one its first device's copy, a split one the part of
each device's slice that no lower rank holds (grad_norm.py counts gradients the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from torch import nn

from .grad_norm import owned_ranges
from .views import follow_root


@dataclass(frozen=True)
class UnsplitParameter:
    """One parameter of the unsplit model: its name there, the first device's tensor (its requires_grad and
    class stand for every device's), and how many elements the unsplit model's tensor has."""

    name: str
    first: nn.Parameter
    numel: int


def unsplit_parameters(model: nn.Module) -> list[UnsplitParameter]:
    """Every parameter of the model the TensorParallel `model` (or view) stands for, tied ones once, in order."""
    follow_root(model)  # a view: its splits as its split model's are now
    per_device = [dict(shard.named_parameters()) for shard in model.module_shards]
    zero = getattr(model, "zero_splits", None) or {}
    out = []
    for name, first in per_device[0].items():
        held = [params.get(name) for params in per_device]
        out.append(UnsplitParameter(name, first, _unsplit_numel(zero.get(name), model.splits.get(name), held)))
    return out


def _unsplit_numel(zero, split, held: list) -> int:
    if zero is not None:  # ZeRO-3: every device holds its own rows
        return sum(p.numel() for p in held if p is not None)
    if split is None:  # whole on every device
        return held[0].numel()
    _, part = split
    total = 0
    for rank, p in enumerate(held):
        local = part.local_size(rank)
        if p is None or local == 0:
            continue
        owned = sum(stop - start for start, stop in owned_ranges(part, rank))
        total += p.numel() // local * owned  # elements per index of the split dimension (also for packed 4-bit)
    return total


def stored_numel(p: nn.Parameter, numel: int) -> int:
    """`numel` as transformers and PEFT count a parameter: a bitsandbytes 4-bit weight packs two values per
    byte of its storage, so they count 2 * element_size() per stored element."""
    if type(p).__name__ != "Params4bit":
        return numel
    if hasattr(p, "element_size"):
        size = p.element_size()
    else:
        size = getattr(getattr(p, "quant_storage", None), "itemsize", 1)
    return numel * 2 * size


def count_parameters(params: Iterable[UnsplitParameter], *, only_trainable: bool = False, exclude: Iterable[str] = ()) -> int:
    """The number of elements of `params` (only the trainable ones; not those named in `exclude`)."""
    skip = set(exclude)
    return sum(
        stored_numel(p.first, p.numel) for p in params
        if p.name not in skip and (p.first.requires_grad or not only_trainable)
    )
