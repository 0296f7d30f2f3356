"""The default optimizer step over a model split on CPU slots: each device's parameters in its shard's thread.

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)   # a plain optimizer, as users write it
    loss.backward(); optimizer.step()                             # steps every shard at once

A torch.optim optimizer steps every parameter it holds in the caller's thread. Over a model split on CPU
slots that is every shard's parameters one after another, and CPU kernels run where they are called, so the
step does not get faster with more devices (on GPUs each device's kernels run asynchronously: nothing to win).
This module makes the step users already write run like `tp.per_device_optimizer`'s, without asking: two
global step hooks of torch.optim (`STEP_HOOKS`, installed while a split model lives: global_hooks.py) take over
the parameters of those models.

0. The pre-hook first hands the step to tensorshard/optimizers (guard.py), for models split by either engine, on
   any device: an optimizer that reads a whole weight (Muon, Adafactor) steps every split weight whole, whose
   gradients are hidden from what follows; an optimizer that cannot be exact over a split weight is refused
   before anything changes.
1. The pre-hook runs the optimizer's own step once per shard, over that shard's parameters, in the shards'
   threads (optimizer.py's `DeviceSteps`), and hides those parameters' gradients (``grad = None``), so the
   optimizer's own step, which runs next, skips them and steps only the parameters no shard holds.
2. The post-hook gives the gradients back before anyone else sees the step's end (should the optimizer's own
   step raise, they stay hidden: the shards' steps already used them).

The results are the optimizer's to the bit: every optimizer it applies to updates each parameter on its own,
whichever others share the step. It applies only where that holds and nothing else can tell the difference;
everywhere else the optimizer's step runs as it always did, in the caller's thread:

- the optimizer is one of torch.optim's per-parameter optimizers (`PER_PARAMETER`), not a subclass with a
  `step()` of its own (which may do more than update parameters, and would run once per device);
- no closure (it would recompute the gradients after the pre-hook used them);
- no step hooks of the optimizer's own (a pre-hook runs after the global ones, so after this step; a
  post-hook would see the hidden gradients), and these hooks are the last global pre-hook and the first
  global post-hook;
- the step is not called from inside one of the model's shards (a gradient hook, during backward).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from ...global_hooks import GlobalHook
from ...logs import get_logger
from ...optimizers import step_split_whole
from ...plans.slices import split_layout
from .engine import TensorParallel, live_models
from .per_device_optimizer import DeviceSteps, PerDeviceOptimizer

logger = get_logger(__name__)

PER_PARAMETER = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop",
                 "ASGD", "SparseAdam", "Adafactor", "Muon")
    if hasattr(torch.optim, name)  # the newer ones are absent from older torch releases
)
_STEPS = {inspect.unwrap(cls.step) for cls in PER_PARAMETER}  # their own step functions, without wrappers


# The gradients each optimizer's current step hid, given back by the post-hook.
_hidden: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[tuple[torch.Tensor, torch.Tensor]]]" = (
    weakref.WeakKeyDictionary()
)


def _before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    _hidden.pop(optimizer, None)  # a step that raised never got its post-hook: those gradients were used
    if isinstance(optimizer, PerDeviceOptimizer):
        return None  # its own step does all of this, after its closure (optimizer.py)
    live = live_models()
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    why_not = _why_not(optimizer, live)
    # Split weights an optimizer must see whole (Muon, Adafactor), on any device and under either engine:
    # stepped whole first (after the closure, if any), or refused before anything changes (optimizers/guard.py).
    stepped, rest = step_split_whole(optimizer, live, closure=closure, why_not=why_not)
    hidden = _hide(stepped)
    models = [m for m in live if all(d.type == "cpu" for d in m._placement)]
    if models and closure is None and why_not is None and inspect.unwrap(type(optimizer).step) in _STEPS:
        hidden += _hide(DeviceSteps(optimizer, models).run(optimizer.param_groups, rest=False))
    if hidden:
        _hidden[optimizer] = hidden
    if rest is None:
        return None
    if "closure" in kwargs:  # the closure ran: the rest of the step gets its loss
        return args, {**kwargs, "closure": rest}
    return (args[0], rest, *args[2:]), kwargs


def _after_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for p, grad in _hidden.pop(optimizer, ()):
        p.grad = grad


def _hide(params: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Set the gradients of `params` (already stepped) to None, so the optimizer's own step skips them."""
    hidden = []
    for p in params:
        if p.grad is not None:
            hidden.append((p, p.grad))
            p.grad = None
    return hidden


def _why_not(optimizer: torch.optim.Optimizer, live: list) -> str | None:
    """Why this step cannot be taken over by the hooks, apart from a closure (None: it can)."""
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return "the optimizer has step hooks of its own, which would run after the split weights were stepped"
    pre, post = torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks
    handles = STEP_HOOKS.handles()
    if handles is None or next(reversed(pre), None) != handles[0].id or next(iter(post), None) != handles[1].id:
        return "another global optimizer step hook was registered after tensorshard's"
    if any(m._group.running_here() for m in live):
        return "the step is called inside one of the model's shards (a gradient hook during backward)"
    return None


def _install() -> list:
    return [torch_optimizer.register_optimizer_step_pre_hook(_before_step),
            torch_optimizer.register_optimizer_step_post_hook(_after_step)]


def _needs_steps(model: Any) -> bool:
    """A model whose steps these hooks see (the engines call `split_model_made` on each model they make): one split
    over several devices of this process, on any device type, or one parallelized under torchrun (step 0: an
    optimizer that reads a whole weight must see its split weights whole under either engine)."""
    if isinstance(model, TensorParallel):
        return model in live_models()
    return split_layout(model) is not None


STEP_HOOKS = GlobalHook("torch.optim step pre/post hooks (engines/inprocess/default_step.py)", _install,
                        needed_by=_needs_steps)
