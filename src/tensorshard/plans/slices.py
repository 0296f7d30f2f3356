"""What an engine reports about a model it split: which slice of which original tensor each device or rank
holds (`SplitLayout`), and the two registries that let the layers above work from that report alone.

A *placement* is ``None`` (the whole tensor, on every rank) or ``(dim, Partition)``: rank r holds the
ranges ``partition.ranges[r]`` of dimension `dim`. `ShardedModel.slice_map` (sharding.py) builds the
original-name -> placement map once; each engine adds what it knows (ZeRO-3 partitions, devices, its
per-process state) and registers a describer with `register_engine`. The checkpoint code calls
`split_layout(model)` and never imports an engine.

`after_split` hooks run when the torchrun engine has split a module in place (the checkpoint package uses
one to give a transformers model a gathering ``save_pretrained``), so no engine imports the layers above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..partition import Partition
from .plan import Plan

Placement = Optional[tuple[int, Partition]]  # None: whole on every rank


@dataclass
class SplitLayout:
    """A split model as its engine describes it."""

    engine: str  # "inprocess" or "torchrun"
    plan: Plan
    placements: dict[str, Placement]  # original state-dict name -> placement (ZeRO-3 partitions included)
    shards: list[nn.Module]  # the module trees this process holds: one per device in-process, the module under torchrun
    devices: list[torch.device]  # where each of `shards` lives
    zero: list[str] = field(default_factory=list)  # names ZeRO-3 partitions along dim 0
    state: Any = None  # torchrun: the engine's per-process state (mesh, comm, how each tensor is stored)


Describer = Callable[[object], Optional[SplitLayout]]
_describers: list[Describer] = []
_after_split: list[Callable[[nn.Module], None]] = []


def register_engine(describe: Describer) -> Describer:
    """Register an engine's describer: ``describe(model)`` is the model's SplitLayout, or None when the
    engine did not split it."""
    _describers.append(describe)
    return describe


def split_layout(model: object) -> SplitLayout | None:
    """The SplitLayout of a model split by any engine; None for anything else (a plain module)."""
    for describe in _describers:
        layout = describe(model)
        if layout is not None:
            return layout
    return None


def after_split(hook: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    """Register `hook(module)`, called on every module an engine has just split in place."""
    _after_split.append(hook)
    return hook


def run_after_split(module: nn.Module) -> None:
    for hook in _after_split:
        hook(module)
