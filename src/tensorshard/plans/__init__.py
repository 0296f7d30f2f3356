"""Plans: which style each module gets. `Plan` is the data; presets and inference produce Plans."""

from __future__ import annotations

import os
from collections.abc import Mapping

from torch import nn

from .plan import Plan, match_pattern

__all__ = ["Plan", "match_pattern", "resolve_plan"]


def resolve_plan(module: nn.Module, plan, world_size: int, *, check: bool | None = None) -> Plan:
    """The plan to use: the one given (a Plan, a {pattern: style} dict or a JSON file), else an automatic one.

    `check`: self-check the plan numerically before splitting (selfcheck.py). None: only inferred plans.
    """
    if plan is None:
        from .auto import auto_plan

        return auto_plan(module, world_size, check=check)
    if isinstance(plan, Plan):
        resolved = plan
    elif isinstance(plan, Mapping):
        resolved = Plan(plan)
    elif isinstance(plan, (str, os.PathLike)):
        resolved = Plan.load(plan)
    else:
        raise TypeError(
            f"plan must be a tensorshard Plan, a {{pattern: style}} dict or a path to a plan JSON file; got {type(plan).__name__}"
        )
    if check:
        from .selfcheck import check_plan

        resolved = check_plan(module, resolved, world_size)
    return resolved
