"""PEFT adapters added to a module after `parallelize`: adopted so that they follow the split, or refused."""

from __future__ import annotations

from torch import nn


def adopt_late_adapters(root: nn.Module) -> None:
    raise NotImplementedError("not yet")
