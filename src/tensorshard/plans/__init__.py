"""Plans: which style each module gets. `Plan` is the data; presets and inference produce Plans.

`resolve_plan` turns what a user passes (a Plan, a dict, a JSON path, rules with a ``to_plan`` method, or
nothing) into the Plan an engine splits by. Inferring a plan and self-checking one live a layer up (tensorshard.plan_inference, whose self-check
runs an engine); that package registers both here when it is imported (`register_inference`), so the
engines resolve plans without importing the layer above them. Likewise a library that wraps layers in place
(PEFT) registers how plans are rewritten for its wrappers (rewriters.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Callable

from torch import nn

from .plan import Plan, match_pattern
from .rewriters import has_wrappers, refuse_unsplittable, rewrite_plan
from .ties import follow_ties

__all__ = ["Plan", "match_pattern", "register_inference", "resolve_plan"]

AutoPlan = Callable[..., Plan]  # (module, world_size, *, check) -> Plan: a preset, else an inferred plan
CheckPlan = Callable[[nn.Module, Plan, int], Plan]  # (module, plan, world_size) -> the plan, failing regions whole
# (module, plan, world_size, *, check) -> {} when the plan's column/row pairs pass; else refuses the plan
# (check=None) or returns Replicate() entries for the failing pairs (check=True)
CheckPairs = Callable[..., dict]

_inference: dict[str, Callable] = {}


def register_inference(*, auto_plan: AutoPlan, check_plan: CheckPlan, check_pairs: CheckPairs) -> None:
    """Install the automatic plan, the self-check and the pair check (tensorshard.plan_inference does, on import)."""
    _inference.update(auto_plan=auto_plan, check_plan=check_plan, check_pairs=check_pairs)


def _inferred(name: str) -> Callable:
    if name not in _inference:
        raise RuntimeError(
            f"no {name} is registered: import tensorshard (or tensorshard.plan_inference) before splitting a model "
            "without a plan or with check=True"
        )
    return _inference[name]


def resolve_plan(module: nn.Module, plan, world_size: int, *, check: bool | None = None, kind=None) -> Plan:
    """The plan to use: the one given (a Plan, a {pattern: style} dict, a JSON file, or an object with a
    ``to_plan(module, world_size)`` method such as a tensorshard.compat.Config), else an automatic one.

    `check`: a given plan's column/row pairs are checked against a traced forward (plan_inference/plancheck.py):
    by default a pair split around an op that mixes features is refused; with True it stays whole and the rest
    of the plan is self-checked numerically (plan_inference/selfcheck.py); False trusts the plan.
    `kind`: the model's kind (model_kind.py) when the caller has it, for the automatic plan.
    """
    refuse_unsplittable(module)  # e.g. a PEFT method no plan can split (rewriters.py)
    if plan is None:
        resolved = _inferred("auto_plan")(module, world_size, check=check, kind=kind)
        return rewrite_plan(module, resolved)
    if isinstance(plan, Plan):
        resolved = plan
    elif callable(getattr(plan, "to_plan", None)):  # rules that become a plan for this model and device count
        resolved = plan.to_plan(module, world_size)  # (tensorshard.compat.Config, the tensor_parallel package's)
        if not isinstance(resolved, Plan):
            raise TypeError(f"{type(plan).__name__}.to_plan() returned {type(resolved).__name__}, not a Plan")
    elif isinstance(plan, Mapping):
        resolved = Plan(plan)
    elif isinstance(plan, (str, os.PathLike)):
        resolved = Plan.load(plan)
    else:
        raise TypeError(
            f"plan must be a tensorshard Plan, a {{pattern: style}} dict or a path to a plan JSON file; got {type(plan).__name__}"
        )
    resolved = follow_ties(module, resolved)  # a tied weight's other holders split alike (ties.py)
    # Wrapped layers (PEFT's LoRA) split with their layer by styles the trace does not follow yet: such models are
    # not pair-checked (check=True still self-checks them numerically).
    if check is not False and world_size > 1 and not has_wrappers(module):
        whole = _inferred("check_pairs")(module, resolved, world_size, check=check)
        if whole:  # check=True: the failing pairs stay whole
            resolved = resolved | whole
    if check:
        resolved = _inferred("check_plan")(module, resolved, world_size)
    return rewrite_plan(module, resolved)  # entries for wrapped layers, e.g. PEFT adapters (rewriters.py)
