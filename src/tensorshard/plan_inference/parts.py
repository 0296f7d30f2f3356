"""Parts of a model that the traced pass does not reach: a vision-language model's vision tower and
projector on a text-only input, a speech-LM's audio encoder.

A multimodal transformers model is a language model plus towers that only run when the input holds
images or audio. The main pass runs on what the model names as its main input (``input_ids``), so the
towers are never called and would stay whole. A *part* is a module the pass did not reach whose parent it
did reach, when it is a transformers model itself (``vision_tower``, ``audio_tower``: it describes its own
input, model_inputs.py) or sits beside one that is (the ``multi_modal_projector``: shaped for its first
layer). Each part gets a plan of its own, inferred (and self-checked) on its own tiny input as if it
were a model: a part's inputs and outputs are whole, as a model's are, so its entries fit into the
whole model's plan unchanged, under the part's name. Other unreached modules (experts no token was routed
to) stay whole, as before, and so does a bare embedding beside a tower (what it is fed is the tower's
output, not ids). A part whose input cannot be built stays whole, with a log line saying so.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from torch import nn

from ..layers import EMBEDDING, layer_kind
from ..logs import get_logger
from ..plans.plan import Plan
from .groups import escape

R = TypeVar("R")

logger = get_logger(__name__)


def unreached_parts(module: nn.Module, reached: set[str]) -> list[str]:
    """Names of the unreached parts of `module` (see the module docstring), in module order."""
    children: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, mod in module.named_modules():
        if name and name not in reached:
            parent = name.rpartition(".")[0]
            if parent in reached:
                children.setdefault(parent, []).append((name, mod))
    parts = []
    for siblings in children.values():
        towers = [name for name, mod in siblings if _describes_inputs(mod) and _holds_layers(mod)]
        if not towers:
            continue
        # A bare embedding beside a tower is fed what the tower makes, not ids we could build (Ovis2's visual
        # table multiplies the tower's probabilities with its rows): it stays whole.
        parts += [name for name, mod in siblings if _holds_layers(mod) and layer_kind(mod) is not EMBEDDING]
    return [name for name, _ in module.named_modules() if name in set(parts)]


def infer_parts(module: nn.Module, reached: set[str], infer: Callable[[nn.Module], R]) -> dict[str, R]:
    """`infer` (plan inference on the part alone) for each unreached part; parts it cannot run stay out
    (whole)."""
    plans = {}
    for name in unreached_parts(module, reached):
        part = module.get_submodule(name)
        try:
            plans[name] = infer(part)
        except Exception as e:  # a part without an input we can build: it stays whole, as before
            logger.info("kept whole: %s (%s) is not reached by the traced pass and could not be traced alone (%s)",
                        name, type(part).__name__, str(e).splitlines()[0] if str(e) else type(e).__name__)
    return plans


def prefixed(name: str, plan: Plan) -> list[tuple[str, object]]:
    """The part's entries as entries of the whole model: every pattern under the part's name."""
    base = escape(name)
    return [(f"{base}.{pattern}" if pattern else base, style) for pattern, style in plan.items()]


def _describes_inputs(mod: nn.Module) -> bool:
    return getattr(mod, "config", None) is not None and isinstance(getattr(mod, "main_input_name", None), str)


def _holds_layers(mod: nn.Module) -> bool:
    return any(layer_kind(m) is not None for m in mod.modules())
