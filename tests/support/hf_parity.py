"""Comparing a split transformers model with the unsplit one it was copied from."""

from __future__ import annotations

import torch

from tensorshard.checkpoint.gather import gathered_state_dict


def gathered_grads(model) -> dict[str, torch.Tensor]:
    """The split model's gradients, assembled to the unsplit model's shapes, by the unsplit model's names
    (ZeRO-3 partitioned parameters included)."""
    shards = list(model.module_shards)
    grads = {}
    zero = getattr(model, "zero_splits", None) or {}
    for name, split in model.splits.items():
        split = zero.get(name, split)
        pieces = [shard.get_parameter(name).grad for shard in shards] if _is_param(shards[0], name) else None
        if pieces is None or pieces[0] is None:
            continue
        grads[name] = pieces[0] if split is None else split[1].assemble([p.to(pieces[0].device) for p in pieces], split[0])
    return grads


def _is_param(module, name: str) -> bool:
    try:
        module.get_parameter(name)
        return True
    except AttributeError:
        return False


def unsplit_state(model) -> dict[str, torch.Tensor]:
    return dict(gathered_state_dict(model))
