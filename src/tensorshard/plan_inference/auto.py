"""The plan used when none is given: a preset for a known architecture, else one inferred from structure.

Inferred plans are self-checked by default (selfcheck.py): each split group is verified numerically on a
copy of its module before the model is split, and a group that fails stays whole. Hand-written presets are
trusted and skip the check unless ``check=True``. A plan translated from a config's ``base_model_tp_plan``
(written for transformers' own engine: a starting point) is validated and self-checked; if any entry does
not apply or any region fails, the inferred plan is used instead, with a warning. ``check=False`` turns
all checks off.
"""

from __future__ import annotations

from torch import nn

from ..logs import get_logger
from ..model_kind import ModelKind, model_kind
from ..plans.plan import Plan
from ..plans.presets import PRESETS, preset_for
from ..plans.sharding import shard_plan
from .infer import infer_plan
from .selfcheck import check_plan

logger = get_logger(__name__)


def auto_plan(module: nn.Module, world_size: int, *, check: bool | None = None, example_inputs=None,
              kind: ModelKind | None = None) -> Plan:
    """`kind`: `module`'s kind as the front door decided it (model_kind.py); None only for the entries that do not
    pass it (torchrun's parallelize, the CLI, hand loading): asked here then."""
    if kind is None:
        kind = model_kind(module)
    if kind.holds_inner:  # a PeftModel, your own module: the inner model's plan, prefixed
        path, model = kind.inner_path, kind.inner
        plan = auto_plan(model, world_size, check=check, example_inputs=example_inputs, kind=kind.inner_kind())
        logger.info("plan for %s: the plan of the %s at %r", type(module).__name__, type(model).__name__, path)
        return Plan((f"{path}.{p}", s) for p, s in plan.items())
    plan = preset_for(module)
    if plan is not None:
        if getattr(getattr(module, "config", None), "model_type", None) in PRESETS:  # hand-written: trusted
            return check_plan(module, plan, world_size, example_inputs=example_inputs) if check else plan
        if check is False or world_size < 2:
            return plan
        problem = _translated_plan_problem(module, plan, world_size, example_inputs)
        if problem is None:
            return plan
        logger.warning(
            "the plan translated from %s's base_model_tp_plan does not fit it (%s); using an inferred plan instead",
            type(module).__name__, problem,
        )
    return infer_plan(module, world_size, example_inputs=example_inputs, check=world_size > 1 if check is None else check)


def _translated_plan_problem(module: nn.Module, plan: Plan, world_size: int, example_inputs) -> str | None:
    """Why a translated plan cannot be used as it is (it does not apply, or a region fails the self-check)."""

    try:
        shard_plan(module, plan, world_size)  # validates every entry; changes nothing
    except (ValueError, TypeError, NotImplementedError) as e:
        return str(e).split("\n")[0]
    checked = check_plan(module, plan, world_size, example_inputs=example_inputs)
    failed = [p for p in checked if p not in plan]
    return f"the self-check kept {', '.join(failed)} whole" if failed else None
