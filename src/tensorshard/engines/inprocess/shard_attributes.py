"""Attributes of a split module: one value on every device, a device's own value, or refused.

Each device holds its own copy of every module, so an attribute a user sets after splitting, through a view
of the split model (``split.model.layers[0].self_attn.scaling = 0.5``), must reach every copy to change what
the model computes. `set_everywhere` does that, or refuses what cannot be done that way:

- a plain value (a flag, a scaling factor, a new attribute): every device's copy gets it; a tensor is moved
  to each device;
- a buffer replaced by assignment: each device gets the new tensor on its device, or its slice of it when
  the plan splits that buffer (the value must have the unsplit shape);
- refused, with the way to do it: a value of the attributes the plan set per device when splitting (a
  head count, a Linear's ``out_features``, a style's forward: `record_per_device` lists them, from how
  the shards differ from the original), a parameter (each device holds its own copy or slice: load new
  values with ``load_state_dict``), a submodule (the plan split the modules there were).

The configuration objects are not copied per device at all (engines/shared_config.py).
"""

from __future__ import annotations

import copy

import weakref
from typing import Any, Sequence

import torch
from torch import nn

from ...styles.local_values import is_local_values
from ..shared_config import is_model_configuration, same_value

# shard module -> the names of its attributes that hold that device's own value (set by the plan's styles)
_PER_DEVICE: "weakref.WeakKeyDictionary[nn.Module, frozenset[str]]" = weakref.WeakKeyDictionary()
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)


def record_per_device(original: nn.Module, shards: Sequence[nn.Module]) -> None:
    """After the styles attached: note, for every module of every shard, the attributes whose value differs
    from the original module's (or that the original lacks): a style gave each device its own."""
    copies = [dict(shard.named_modules(remove_duplicate=False)) for shard in shards]
    for name, module in original.named_modules(remove_duplicate=False):
        before = vars(module)
        for modules in copies:
            mod = modules.get(name)
            if mod is None or mod in _PER_DEVICE:
                continue
            _PER_DEVICE[mod] = frozenset(
                attr for attr, value in vars(mod).items()
                if not attr.startswith("_") and attr != "training" and _differs(value, before.get(attr, _MISSING))
            )


_MISSING = object()


def _differs(value: Any, before: Any) -> bool:
    if before is _MISSING or is_local_values(value):
        return True
    if isinstance(value, torch.Tensor) and isinstance(before, torch.Tensor):
        return value.shape != before.shape
    if isinstance(value, _PLAIN) or isinstance(value, (tuple, list)):
        try:
            return type(value) is not type(before) or bool(value != before)
        except Exception:  # noqa: BLE001 - values that do not compare: not ours to judge
            return False
    return False  # another object: a copy of the original's, not a per-device value


def set_everywhere(parts: Sequence[nn.Module], devices: Sequence[torch.device], splits: dict, name: str,
                   value: Any, where: str) -> None:
    """``part.<name> = value`` on every device's copy `parts` (see the module docstring). `splits`: how this
    module's own tensors are split (``{"bias": (dim, Partition)}``); `where`: the module's path in the model
    ("" for the model itself), for errors."""
    first = parts[0]
    label, full = where or type(first).__name__, f"{where}.{name}" if where else name
    if name in first._modules or isinstance(value, nn.Module):
        raise NotImplementedError(
            f"{label}.{name} = {type(value).__name__}: a split model's submodules cannot be replaced (each device "
            "holds its own copy, split by the plan at split time). Replace it in the unsplit model before splitting."
        )
    if name in first._parameters or isinstance(value, nn.Parameter):
        raise NotImplementedError(
            f"{label}.{name}: a split model's parameters are not replaced by assignment (each device holds its "
            f"own copy or slice). Load new values with split.load_state_dict({{'{full}': tensor}}, "
            "strict=False) under the unsplit model's names (each device takes its slice), or replace it before "
            "splitting."
        )
    current = vars(first).get(name)
    if (is_model_configuration(current) or is_local_values(current)) and value is not current:
        raise AttributeError(
            f"{label}.{name}: a split model keeps one configuration, shared by every device "
            "(and read by every layer): set its fields (split.config.pad_token_id = ...) instead of replacing it"
        )
    if name in _PER_DEVICE.get(first, ()):
        if all(same_value(getattr(part, name), value) for part in parts):
            return  # unchanged
        held = [getattr(part, name) for part in parts]
        values = f" ({', '.join(map(repr, held))})" if all(isinstance(v, _PLAIN) for v in held) else ""
        raise AttributeError(
            f"{label}.{name} holds each device's own value in a split model{values}, set by the plan when "
            "splitting (a local size, a forward with collectives): the split depends on it. Change the unsplit "
            "model before splitting."
        )
    if name in first._buffers:
        _replace_buffer(parts, devices, splits.get(name), name, value, label)
        return
    # every device its own copy of a tensor or of a list, dict or set (the shards' threads may change it in place
    # at the same time); other values are shared as they are
    local = [value.to(device, copy=True) if isinstance(value, torch.Tensor)
             else copy.deepcopy(value) if isinstance(value, list | dict | set | bytearray) else value for device in devices]
    for part, v in zip(parts, local):
        setattr(part, name, v)


def _replace_buffer(parts, devices, split, name: str, value: Any, where: str) -> None:
    if value is not None and not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}.{name} is a buffer: assign a tensor (or None), not {type(value).__name__}")
    held = [part._buffers[name] for part in parts]
    if value is not None and split is not None:
        dim, partition = split
        whole = list(held[0].shape)
        whole[dim] = partition.size
        if list(value.shape) != whole:
            raise ValueError(
                f"{where}.{name}: the plan splits this buffer over the devices (dim {dim}); assign a tensor of its "
                f"unsplit shape {whole}, not {list(value.shape)}: each device takes its slice"
            )
    elif value is not None and any(h is not None and h.shape != held[0].shape for h in held):
        raise NotImplementedError(
            f"{where}.{name}: the devices hold this buffer in different shapes; set it before splitting"
        )
    # each device its own tensor (a buffer a forward updates in place is updated once per device); all made
    # before any is set, so a failure leaves every device as it was
    local = [
        None if value is None else (split[1].take(value, split[0], rank) if split else value).detach().to(device, copy=True)
        for rank, device in enumerate(devices)
    ]
    for part, tensor in zip(parts, local):
        setattr(part, name, tensor)

