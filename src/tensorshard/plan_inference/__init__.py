"""Plan inference: a plan for a model no preset covers, and the numerical self-check of any plan.

Tracing follows the features through one forward call: trace.py runs it and evidence.py holds what it
found; tracer.py intercepts torch functions, oprules.py and shadows.py move the feature ids (features.py)
op by op, layer_roles.py gives each layer its role, gradient_sources.py finds the whole tensors that would
carry gradients, inputs.py makes the tiny input. structure.py and groups.py turn what was seen into
column/row groups and head layouts; infer.py assembles the Plan; selfcheck.py verifies each group on a
copy with the in-process engine (which is why this package sits above the engines); auto.py picks a preset
or an inferred plan.

plancheck.py checks a given plan's column/row pairs against a trace. Importing this package registers
`auto_plan`, `check_plan` and `keep_whole` (the pair check) with `tensorshard.plans.resolve_plan`, which
the engines call.
"""

from ..plans import register_inference
from .auto import auto_plan
from .infer import infer, infer_plan
from .plancheck import keep_whole
from .selfcheck import check_plan

register_inference(auto_plan=auto_plan, check_plan=check_plan, check_pairs=keep_whole)

__all__ = ["auto_plan", "check_plan", "infer", "infer_plan"]
