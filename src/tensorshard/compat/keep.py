"""Splitting a module that stays usable, as the tensor_parallel package did.

The original built its shards from copies of the module's tensors and left the module as it was, so code
wraps one model several times (once per config, to compare state dicts) or keeps calling it afterwards.
tensorshard's engines consume the module instead: its tensors move into the shards, and it is left on the
meta device, so that the weights never exist twice. `tensorshard.compat` keeps the original's behaviour
by default:

    split = tp.tensor_parallel(model, devices)                 # model still holds its weights, unchanged
    split = tp.tensor_parallel(model, devices, consume=True)   # tensorshard's: the weights move, once

How: the engine splits a *borrowing copy* of the module (its own module tree over the very same tensor
objects), so the engine's bookkeeping (emptying what it consumed, marking it split) touches only the copy.
Slices are copied onto their devices anyway; a tensor kept whole on the device it already lives on would be
taken over by the first shard, so after splitting every shard tensor still sharing storage with the module
gets its own copy. Memory: the module plus the shards (one more copy of the weights, spread over the
devices, than ``consume=True``), as with the original; no third copy exists at any point. Under torchrun the
module is split in place by the engine, so a deep copy is split instead (one more full copy, per process).
"""

from __future__ import annotations

import copy
import itertools
from typing import Callable

import torch
from torch import nn

from ..engines.resplit import refuse_split_twice


def split_keeping(module: nn.Module, split: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """``split(borrowing copy of module)``, then every tensor of the result that shares storage with
    `module` gets its own (see the module doc). `module` is left as it was, also if splitting fails."""
    refuse_split_twice(module)  # before copying: a split model's copy would be a whole second split
    tensors = list(itertools.chain(module.parameters(), module.buffers()))
    borrowing = copy.deepcopy(module, memo={id(t): t for t in tensors})  # new modules, the same tensors
    result = split(borrowing)
    held = {_storage(t) for t in tensors} - {None}
    for t in itertools.chain(result.parameters(), result.buffers()):
        if _storage(t) in held:
            with torch.no_grad():
                t.data = t.data.clone()
    return result


def split_copy(module: nn.Module, split: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """For engines that split in place (torchrun): split a deep copy."""
    refuse_split_twice(module)
    return split(copy.deepcopy(module))


def _storage(t: torch.Tensor) -> int | None:
    if t.is_meta or t.numel() == 0:
        return None
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's own slice
    return local.untyped_storage().data_ptr()
