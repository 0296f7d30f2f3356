"""Plan rewriters: a plan written for a bare model, rewritten for layers a library wrapped in place.

A plan names the model's own layers (``"...q_proj": ColwiseParallel()``). A library that wraps a layer at its
name (PEFT keeps the layer as ``q_proj.base_layer`` and adds its adapter beside it) needs such entries rewritten
before anything is split, and may hold something no plan can split. It registers a `PlanRewriter` here when
it is imported (integrations/peft/adapter_plan.py does, and ``import tensorshard`` imports it), so that
`resolve_plan` rewrites plans without importing the layer above it:

    register_rewriter(PlanRewriter("PEFT adapters", applies=has_adapters, rewrite=adapt_plan,
                                   refuse=refuse_prompt_learning))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from .plan import Plan


@dataclass(frozen=True)
class PlanRewriter:
    """What one library's wrappers need of a plan."""

    what: str  # what it rewrites for, in logs and messages ("PEFT adapters")
    applies: Callable[[nn.Module], bool]  # whether the module holds such wrappers
    rewrite: Callable[[nn.Module, Plan], Plan]  # the plan, its entries for the wrappers rewritten
    refuse: Callable[[nn.Module], None] = lambda module: None  # raises for a module no plan can split


_rewriters: dict[str, PlanRewriter] = {}


def register_rewriter(rewriter: PlanRewriter) -> PlanRewriter:
    """Run `rewriter` on every plan resolved from now on (one per `what`: registering again replaces it)."""
    _rewriters[rewriter.what] = rewriter
    return rewriter


def refuse_unsplittable(module: nn.Module) -> None:
    """Raise, before anything is resolved or built, for a module a registered rewriter says no plan can split."""
    for rewriter in _rewriters.values():
        rewriter.refuse(module)


def has_wrappers(module: nn.Module) -> bool:
    """Whether a registered rewriter will rewrite plans for `module`."""
    return any(rewriter.applies(module) for rewriter in _rewriters.values())


def rewrite_plan(module: nn.Module, plan: Plan) -> Plan:
    """`plan` as the engines split `module` by: rewritten by every registered rewriter that applies."""
    for rewriter in _rewriters.values():
        if rewriter.applies(module):
            plan = rewriter.rewrite(module, plan)
    return plan
