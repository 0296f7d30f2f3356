"""Plan inference from a model's structure."""

from __future__ import annotations

from torch import nn

from .plan import Plan


def infer_plan(module: nn.Module, world_size: int) -> Plan:
    raise NotImplementedError(
        f"no preset for {type(module).__name__} and plan inference is not available yet; pass plan=tp.Plan({{...}})"
    )
