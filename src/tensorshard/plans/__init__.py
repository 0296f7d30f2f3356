"""Plans: which style each module gets. `Plan` is the data; presets and inference produce Plans."""

from __future__ import annotations

import os
from collections.abc import Mapping

from torch import nn

from .plan import Plan, match_pattern

__all__ = ["Plan", "match_pattern", "resolve_plan"]


def resolve_plan(module: nn.Module, plan, world_size: int) -> Plan:
    """The plan to use: the one given (a Plan, a {pattern: style} dict or a JSON file), else an automatic one."""
    if plan is None:
        from .auto import auto_plan

        return auto_plan(module, world_size)
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        return Plan(plan)
    if isinstance(plan, (str, os.PathLike)):
        return Plan.load(plan)
    raise TypeError(
        f"plan must be a tensorshard Plan, a {{pattern: style}} dict or a path to a plan JSON file; got {type(plan).__name__}"
    )
