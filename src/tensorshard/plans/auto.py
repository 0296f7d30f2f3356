"""The plan used when none is given: a preset for a known architecture, else one inferred from structure."""

from __future__ import annotations

from torch import nn

from .plan import Plan


def auto_plan(module: nn.Module, world_size: int) -> Plan:
    from .presets import preset_for

    plan = preset_for(module)
    if plan is not None:
        return plan
    from .infer import infer_plan

    return infer_plan(module, world_size)
