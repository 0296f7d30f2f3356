"""Gathered saving: the state dict of the unsplit model, assembled from the shards one tensor at a time.

    with tp.save_tensor_parallel(model):
        torch.save(model.state_dict(), "model.pt")   # unsplit keys and shapes, loadable by a plain model

`gathered_state_dict(model)` yields ``(name, tensor)`` pairs in the original model's order, each tensor
assembled on the CPU just before it is yielded, so a caller that writes and drops each tensor never holds
more than one gathered tensor besides the shards. Keys are the original module's (no ``module_shards.N``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


def _shard_tensor(shard: nn.Module, name: str) -> torch.Tensor:
    module_name, _, tensor_name = name.rpartition(".")
    module = shard.get_submodule(module_name) if module_name else shard
    tensor = module._parameters.get(tensor_name)
    return module._buffers[tensor_name] if tensor is None else tensor


def gathered_state_dict(model: nn.Module, *, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the unsplit model's state dict entries, one gathered tensor at a time (on `device`)."""
    splits = getattr(model, "splits", None)
    if splits is None:
        raise TypeError(f"gathered_state_dict needs a TensorParallel model; got {type(model).__name__}")
    shards = list(model.module_shards)
    wanted = set(shards[0].state_dict(keep_vars=True))  # persistent buffers only, as a plain model saves
    for name, split in splits.items():
        if name not in wanted:
            continue
        pieces = [_shard_tensor(s, name).detach() for s in shards]
        if split is None:
            yield name, pieces[0].to(device, copy=pieces[0].device == torch.device(device))
        else:
            dim, partition = split
            yield name, partition.assemble([p.to(device) for p in pieces], dim)


@contextmanager
def save_tensor_parallel(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``model.state_dict()`` returns the unsplit model's state dict (as the
    tensor_parallel package's context of the same name does)."""
    if getattr(model, "splits", None) is None:
        raise TypeError(f"save_tensor_parallel needs a TensorParallel model; got {type(model).__name__}")
    model._gather_state_dict = True
    try:
        yield model
    finally:
        model._gather_state_dict = False
