"""Putting a module back as it was when splitting it fails halfway.

The in-process engine moves the original module's tensors into the shards one by one, releasing each
original as soon as every device has its slice, so the whole model never exists twice. If anything fails
before the end (out of memory on a device, a style's error, Ctrl-C), `restore` undoes that: every
released tensor goes back to its module, as the same object when the caller still holds it, else
rebuilt from the slices the shards got (tied tensors stay tied).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...partition import Partition


@dataclass
class Released:
    """A tensor moved out of the original module, and what it takes to put it back."""

    module: nn.Module
    kind: str
    name: str
    ref: Any  # weakref to the original tensor: alive while the user still holds it
    key: int
    device: torch.device
    requires_grad: bool
    split: tuple[int, Partition] | None


def restore(released: list[Released], made: dict, world: int) -> None:
    """Undo step 2 of `build_shards` (build.py): each released tensor goes back, rebuilt from its slices if it is gone."""
    restored: dict[int, torch.Tensor] = {}  # by original tensor: tied tensors stay tied
    for r in released:
        if r.key not in restored:
            t = r.ref()
            if t is None:
                pieces = [made[(r.key, rank)].detach().to(r.device) for rank in range(world)]
                data = pieces[0] if r.split is None else r.split[1].assemble(pieces, r.split[0])
                t = nn.Parameter(data, requires_grad=r.requires_grad) if r.kind == "param" else data
            restored[r.key] = t
        (r.module._parameters if r.kind == "param" else r.module._buffers)[r.name] = restored[r.key]
