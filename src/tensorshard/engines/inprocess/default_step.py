"""The default optimizer step over a model split on CPU slots: each device's parameters in its shard's thread.

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)   # a plain optimizer, as users write it
    loss.backward(); optimizer.step()                             # steps every shard at once

A torch.optim optimizer steps every parameter it holds in the caller's thread. Over a model split on CPU
slots that is every shard's parameters one after another, and CPU kernels run where they are called, so the
step does not get faster with more devices (on GPUs each device's kernels run asynchronously: nothing to win).
This module makes the step users already write run like `tp.per_device_optimizer`'s, without asking: two
global step hooks of torch.optim (`STEP_HOOKS`, installed while an in-process model split over several CPU
slots lives: global_hooks.py) take over the parameters of those models.

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
import logging
import weakref
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from ...global_hooks import GlobalHook
from .engine import TensorParallel, live_models
from .optimizer import DeviceSteps, PerDeviceOptimizer

logger = logging.getLogger(__name__)

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


def _before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    _hidden.pop(optimizer, None)  # a step that raised never got its post-hook: those gradients were used
    models = [m for m in live_models() if all(d.type == "cpu" for d in m._placement)]
    if not models or not _applies(optimizer, args, kwargs) or any(m._group.running_here() for m in models):
        return None
    hidden = []
    for p in DeviceSteps(optimizer, models).run(optimizer.param_groups, rest=False):
        if p.grad is not None:
            hidden.append((p, p.grad))
            p.grad = None
    if hidden:
        _hidden[optimizer] = hidden
    return None


def _after_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for p, grad in _hidden.pop(optimizer, ()):
        p.grad = grad


def _applies(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> bool:
    if isinstance(optimizer, PerDeviceOptimizer) or inspect.unwrap(type(optimizer).step) not in _STEPS:
        return False
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is not None or optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return False
    pre, post = torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks
    handles = STEP_HOOKS.handles()
    return handles is not None and next(reversed(pre), None) == handles[0].id and next(iter(post), None) == handles[1].id


def _install() -> list:
    return [torch_optimizer.register_optimizer_step_pre_hook(_before_step),
            torch_optimizer.register_optimizer_step_post_hook(_after_step)]


def _needs_steps(model: Any) -> bool:
    """A model whose steps these hooks take over (the engine calls `split_model_made` on each model it makes)."""
    return isinstance(model, TensorParallel) and model in live_models() and all(d.type == "cpu" for d in model._placement)


STEP_HOOKS = GlobalHook("torch.optim step pre/post hooks (engines/inprocess/default_step.py)", _install,
                        needed_by=_needs_steps)
