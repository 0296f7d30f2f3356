"""``split.load_state_dict(unsplit_state_dict)``: what is missing or unexpected, by the unsplit names.

A split model's own `state_dict()` has keys ``module_shards.<rank>.<name>``; what users have at hand is the
unsplit model's (``model.state_dict()`` before splitting, a checkpoint of it). The engine's load pre-hook
(engine.py, `_load_unsplit`) cuts each such tensor for every device. Given a wholly unsplit state dict, this
checks it first the way torch would, but in the names the user knows: missing and unexpected keys are unsplit
names (torch would list ``module_shards.N...`` names), and a tied weight counts as present when any of its
names is (a checkpoint keeps one of them).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys


def is_unsplit(state_dict: Mapping[str, torch.Tensor]) -> bool:
    return bool(state_dict) and not any(k.startswith("module_shards.") for k in state_dict)


def load_unsplit(model, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> _IncompatibleKeys:
    """Check the unsplit `state_dict` by its names, then load it into the TensorParallel `model`."""
    shards = list(model.module_shards)
    names_of: dict[str, list[str]] = {}  # every state-dict name -> the names of the same tensor
    by_tensor: dict[int, list[str]] = {}
    for name, t in shards[0].state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(t), []).append(name)
        names_of[name] = by_tensor[id(t)]
    missing = [n for n in names_of if not any(a in state_dict for a in names_of[n])]
    unexpected = [n for n in state_dict if n not in names_of]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading the unsplit state dict into the split {type(model).__name__}: "
            + (f"missing keys: {_names(missing)}. " if missing else "")
            + (f"unexpected keys: {_names(unexpected)}. " if unexpected else "")
            + "Pass the unsplit model's state dict (or strict=False to load the keys that match)."
        )
    known = {n: t for n, t in state_dict.items() if n in names_of}
    nn.Module.load_state_dict(model, known, strict=False)  # the engine's pre-hook cuts each tensor per device
    return _IncompatibleKeys(missing, unexpected)


def _names(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" (and {len(names) - limit} more)" if len(names) > limit else "")
