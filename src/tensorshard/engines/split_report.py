"""The log line that ends a split (both engines), at WARNING when the split does little.

Tensor parallelism pays off through the big layers it splits. A split that splits nothing, only the ends
(the input embedding and the output head) or under half of the model's parameters leaves each device holding
most of the model; `report_split` says so at WARNING level (Python shows WARNING by default, not INFO),
naming the largest layers left whole and why: the reason plan inference recorded (``Plan.whole``), a
`Replicate` entry, or no plan entry at all. Otherwise one INFO line summarises the split.
"""

from __future__ import annotations


from torch import nn

from ..layers import EMBEDDING, layer_kind
from ..logs import get_logger
from ..plans.plan import Plan
from ..styles import ColwiseParallel, EmbeddingParallel, Replicate, VocabParallelHead

logger = get_logger(__name__)

SPLIT_AT_LEAST = 0.5  # of the model's parameters; below it the split is reported as a warning


def report_split(module: nn.Module, plan: Plan, split_modules: set[str], world: int, summary: str) -> None:
    """Log `summary` (the engine's line: what it split, over what), at WARNING with the largest layers left
    whole when the plan splits little of `module` (only shapes are read: the module may be on meta)."""
    layers = {n: m for n, m in module.named_modules() if _numel(m)}  # every module holding parameters
    total = sum(_numel(m) for m in layers.values())
    split = sum(_numel(m) for n, m in layers.items() if n in split_modules)
    ends_only = bool(split_modules) and all(_is_end(module, n, plan) for n in split_modules)
    whole = sorted((n for n in layers if n not in split_modules), key=lambda n: -_numel(layers[n]))
    if world < 2 or not whole or (split >= SPLIT_AT_LEAST * total and not ends_only):
        logger.info("%s", summary)
        return
    what = "nothing" if not split_modules else ("only the ends (embeddings, output head)" if ends_only else f"{split / total:.0%} of the parameters")
    largest = "; ".join(f"{n} ({type(layers[n]).__name__}, {_numel(layers[n]):,} parameters): {_why(module, n, plan)}" for n in whole[:3])
    logger.warning(
        "%s. The plan splits %s: each device holds %s model. Largest layers left whole: %s. Write a plan for them "
        "(docs/plans.md) or see why with tp.explain / `tensorshard plan`.",
        summary, what, "most of the" if split_modules else "the whole", largest,
    )


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters(recurse=False))


def _is_end(module: nn.Module, name: str, plan: Plan) -> bool:
    hit = plan.match(name)
    style = hit[1] if hit else None
    if isinstance(style, (EmbeddingParallel, VocabParallelHead)):
        return True
    return (isinstance(style, ColwiseParallel) and style.gather_output) or layer_kind(module.get_submodule(name)) is EMBEDDING


def _why(module: nn.Module, name: str, plan: Plan) -> str:
    reason = plan.whole.get(name)
    if reason:
        return reason
    hit = plan.match(name)
    if hit is None:
        kind = layer_kind(module.get_submodule(name))
        return "no plan entry matches it" if kind is not None else f"no style splits a {type(module.get_submodule(name)).__name__}"
    if isinstance(hit[1], Replicate):
        return f"the plan replicates it ({hit[0]!r})"
    return f"the plan's {hit[0]!r} leaves it whole"
