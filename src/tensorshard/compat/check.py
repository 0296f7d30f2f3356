"""The last step of translating a tensor_parallel config: the plan must split every tensor as the config does.

For each tensor a state rule splits, the config's own action is applied to the indices of the split
dimension (a tensor of shape 1 x ... x size x ... x 1), which says exactly which rows each device gets
from the original package; tensorshard's split of the same tensor (from the plan, computed without
touching the model) must give the same rows in the same order. Where they differ the translation is
refused rather than rearranged: grouped-query heads that the original would cut so that a device's query
heads miss their KV heads, for one.
"""

from __future__ import annotations

import torch
from torch import nn

from ..plans.sharding import shard_plan
from ..plans.plan import Plan
from .bare import adapted, bare_tensors
from .rules import RuleTables, read_action


class UntranslatableConfig(ValueError):
    """A tensor_parallel config with rules tensorshard cannot run as written; the message lists them."""


def check_against_config(config: RuleTables, model: nn.Module, plan: Plan, world: int) -> None:
    """Each split tensor: the rows tensorshard gives every device == the rows the config's action gives."""
    layout = shard_plan(model, adapted(model, plan), world)
    problems = []
    seen: set[int] = set()
    for name, t in bare_tensors(model):
        hit = config.state_rule(name)
        if hit is None or id(t) in seen:
            continue
        seen.add(id(t))
        rule = read_action(hit[1], world)
        if isinstance(rule, str) or rule.kind != "split":
            continue
        dim = rule.dim % t.dim()
        split = layout.split_of(t)
        shape = [1] * t.dim()
        shape[dim] = t.shape[dim]
        index = torch.arange(t.shape[dim]).view(shape)
        action = rule.action(world)
        expected = [action(index, r).flatten().tolist() for r in range(world)]
        got = None
        if split is not None and split[0] == dim:
            got = [[i for a, b in split[1].ranges[r] for i in range(a, b)] for r in range(world)]
        if got != expected:
            problems.append(
                f"{name}: the config's {rule.text} gives the devices {_rows(expected)} along dim {dim}; tensorshard's "
                f"split would give {_rows(got) if got else 'no split'}"
            )
    if problems:
        raise UntranslatableConfig(
            "the translated plan would not split these tensors as the tensor_parallel config does (with grouped-query "
            "attention, a device's query heads must read its own KV heads):\n" + "\n".join(f"  - {p}" for p in problems)
            + "\nUse a device count that divides the head counts, or tensorshard's preset (tensor_parallel_config=None)."
        )


def _rows(per_rank: list[list[int]]) -> str:
    def span(ix: list[int]) -> str:
        return f"{ix[0]}..{ix[-1]}" if ix and ix == list(range(ix[0], ix[-1] + 1)) else f"{len(ix)} rows"

    return "[" + ", ".join(span(ix) for ix in per_rank) + "]"
