"""Before an optimizer steps: split weights of per-tensor optimizers stepped whole, the inexact refused.

Called at the start of every optimizer step while a split model is alive (the global step pre-hook of
engines/inprocess/default_step.py, and `tp.per_device_optimizer`'s step after its closure):

1. Nothing for elementwise optimizers (kinds.py): a slice steps like the same entries of the whole weight.
2. For a per-tensor optimizer (Muon, Adafactor), every split weight it holds is stepped whole (whole.py) and
   its gradient hidden from the rest of the step, which updates only what is not split.
3. Refused, with a `TypeError` naming the first split weight, why and the way out, before any parameter
   changes: an optimizer kinds.py refuses (bitsandbytes' LAMB and LARS, LBFGS, an override of a per-tensor
   optimizer's step), and a per-tensor one whose step the pre-hook cannot see whole (step hooks of the
   optimizer's own, which run after it; a step inside backward). A closure (it computes the gradients) is
   evaluated first, once; the optimizer's own step then gets its loss.

Models split by either engine are found through `split_layout` (plans/slices.py): the in-process engine
passes its live models, and torchrun-split modules are tracked here from the engine's `after_split` hook.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

from ..plans.slices import after_split, split_layout
from .kinds import ELEMENTWISE, REFUSED, kind_of, why_refused
from .whole import SplitTensor, split_tensors, step_whole

_torchrun_models: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


@after_split
def _track(module: nn.Module) -> None:
    _torchrun_models.add(module)


def step_split_whole(
    optimizer: torch.optim.Optimizer,
    models: list[nn.Module],
    *,
    closure: Callable[[], Any] | None = None,
    why_not: str | None = None,
) -> tuple[list[torch.Tensor], Callable[[], Any] | None]:
    """Step the split weights `optimizer` must see whole (see this module's docstring). Returns them, whose
    gradients the caller hides from the rest of the step, and, when the step's `closure` had to run first (it
    computes the gradients), a closure for the rest of the step that returns its loss without running again.
    `models`: the in-process split models alive; `why_not`: why the step cannot be taken over here (refused if
    a split weight needs it)."""
    models = [*models, *_torchrun_models]
    if not models or kind_of(optimizer) == ELEMENTWISE:  # the common case costs two lookups per step
        return [], None
    found = split_tensors(layout for m in models if (layout := split_layout(m)) is not None)
    per_group = [_split_in(group, found) for group in optimizer.param_groups]
    first = next((t for split in per_group for t in split), None)
    if first is None:
        return [], None
    name = type(optimizer).__name__
    if kind_of(optimizer) == REFUSED:
        raise TypeError(
            f"{name} cannot step {first.name} exactly: the plan splits it, and {why_refused(optimizer)}. Nothing "
            f"was changed. Give the split weights to an elementwise optimizer (AdamW, SGD) or to torch.optim.Muon / "
            f"Adafactor, and keep {name} for weights the plan leaves whole; or leave {first.name} whole in the plan."
        )
    if why_not:
        raise RuntimeError(
            f"{name} must see {first.name} whole (the plan splits it), which this step does not allow: {why_not}. "
            "Nothing was changed. Change the gradients before calling step() rather than in a step hook (clip with "
            "clip_grad_norm_ first), or, in one process, wrap the optimizer: tp.per_device_optimizer(optimizer, "
            "model) fires its hooks around the whole-weight step."
        )
    odd = next((t for split in per_group for t in split if t.unsupported), None)
    if odd is not None:
        raise TypeError(f"{name} cannot step {odd.name} whole: {odd.unsupported}. Nothing was changed.")
    for group_index, (group, split) in enumerate(zip(optimizer.param_groups, per_group)):
        held = {id(p) for p in group["params"]}
        for t in split:
            if not all(id(p) in held for p in t.params):
                raise ValueError(
                    f"param group {group_index} of the {name} holds some devices' slices of {t.name} but not all; "
                    "the optimizer steps it whole, so every slice must be in the same param group. Build the "
                    "optimizer over model.parameters() (or the split model's named_parameters()). Nothing was changed."
                )
    rest = None
    if closure is not None:  # as Muon's and Adafactor's own step do first (Lightning always passes one)
        with torch.enable_grad():
            loss = closure()
        rest = lambda: loss  # noqa: E731
    with_grads = [[t for t in split if t.params[0].grad is not None] for split in per_group]
    return step_whole(optimizer, optimizer.param_groups, with_grads), rest


def _split_in(group: dict, found: dict[int, SplitTensor]) -> list[SplitTensor]:
    """The split tensors with a slice in `group`, each once, in the group's order."""
    out: dict[int, SplitTensor] = {}
    for p in group["params"]:
        t = found.get(id(p))
        if t is not None:
            out.setdefault(id(t), t)
    return list(out.values())
