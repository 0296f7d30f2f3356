"""The plan used when none is given: a preset for a known architecture, else one inferred from structure.

Inferred plans are self-checked by default (selfcheck.py): each split group is verified numerically on a
copy of its module before the model is split, and a group that fails stays whole. Presets are trusted
and skip the check unless ``check=True``; ``check=False`` turns it off for inferred plans too.
"""

from __future__ import annotations

import logging

from torch import nn

from .plan import Plan

logger = logging.getLogger(__name__)


def auto_plan(module: nn.Module, world_size: int, *, check: bool | None = None, example_inputs=None) -> Plan:
    from .presets import preset_for

    plan = preset_for(module)
    if plan is not None:
        if check:
            from .selfcheck import check_plan

            plan = check_plan(module, plan, world_size, example_inputs=example_inputs)
        return plan
    from .infer import infer_plan

    return infer_plan(module, world_size, example_inputs=example_inputs, check=world_size > 1 if check is None else check)
