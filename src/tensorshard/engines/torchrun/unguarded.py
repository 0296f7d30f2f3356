"""Later tokens of the compiled decode step under torchrun run without dynamo's guard tree, cheaper checks of ours
in its place.

    unguarded = Unguarded(model)                        # one per generating model (decoding.py)
    key = unguarded.key(args, kwargs)                   # what the skipped guards would have caught, per call
    with unguarded.stance(skip := unguarded.may_skip(key)):
        out = compiled(*args, **kwargs)
    unguarded.ran(key, skip, compiled_now)

Each rank's compiled decode step is one dynamo frame whose guards are evaluated before every token: for
SmolLM2-135M's shape at 2 ranks ~6,000 checks (every module's attributes and flags, every weight), 2-3 ms of a
~30 ms token. Once a kind of call (`key`) has run with every guard evaluated and compiled nothing, the later
calls of that kind run under `torch.compiler.set_stance(skip_guard_eval_unsafe=True)`: dynamo then evaluates only
its differentiating guards, those on the tensors it reads that are not parameters (the inputs, the cache's
tensors, the weights' local views, engines/torchrun/local_views.py: shapes, dtypes, strides, devices) and every
guard that once failed (what told its graphs apart), a few hundred checks, all in C++.

What the other guards would catch is checked here on every call, before the stance is chosen:

- the kind of call: every tensor argument's shape and dtype, the cache's class and each layer's length and state,
  the plain arguments by value (``use_cache``, ``logits_to_keep``) and the others by type, CPU autocast, inference
  mode;
- no gradient, and the model and every module holding split tensors in eval mode (the caller's
  `LocalViews.all_local` being in force says so);
- no module, parameter or buffer registered on a split model since (registrations.py: a PEFT adapter added);
- every layer wrapper's settings (layers.py `LayerWrapper.settings`: PEFT's active and merged adapters, whether
  they are disabled, their scales), read from the wrappers found below the model at the last registration.

Any of these changing makes another key, whose first calls evaluate every guard (dynamo recompiles where it must);
it runs unguarded from the call after one that compiled nothing. A call that compiles while unguarded (the
differentiating guards caught something this list did not) makes its key guarded again. Weights changed in place
or replaced by tensors of the same shape are read afresh every call, as with the guards (a replaced Parameter is
a registration). ``TENSORSHARD_SKIP_GUARDS=0`` evaluates every guard on every call (to compare, or to rule this
out); a torch without the stance's option (before 2.6) always does.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any, Hashable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ...registrations import registrations
from ..decode_decision import WrapperSettings

_PLAIN = (bool, int, float, str, type(None))
ENV = "TENSORSHARD_SKIP_GUARDS"  # "0": every guard evaluated on every call


def supported() -> bool:
    """Whether this torch has the stance option (torch 2.6 and later) and a readable current stance."""
    stance = getattr(getattr(torch._dynamo, "eval_frame", None), "_stance", None)
    params = inspect.signature(torch.compiler.set_stance).parameters
    return "skip_guard_eval_unsafe" in params and hasattr(stance, "stance") and hasattr(stance, "backend")


class Unguarded:
    """Which kinds of call of one generating model's compiled decode step may run without dynamo's guard tree."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.warm: set[Hashable] = set()  # keys whose last guarded call compiled nothing
        self.supported = supported()
        self.settings = WrapperSettings(model)
        self._seen = -1  # registrations.py's count at the last call

    def key(self, args: tuple, kwargs: dict) -> Hashable:
        """What the guards left out are checked on, as one hashable (see the module docstring)."""
        leaves, spec = tree_flatten((args, kwargs))
        kind = tuple(_leaf(x) for x in leaves)
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        seen = registrations()
        if seen != self._seen:
            self.warm.clear()  # (the count only grows: keys of an earlier count never come back)
            self._seen = seen
        return str(spec), kind, autocast, torch.is_inference_mode_enabled(), seen, self.settings()

    def may_skip(self, key: Hashable, quiet: bool) -> bool:
        """Run this call without the guard tree? `quiet`: `LocalViews.all_local` put the local views in place (no
        gradient, every module holding split tensors in eval mode)."""
        return key in self.warm and self.may_skip_warm(quiet)

    def may_skip_warm(self, quiet: bool) -> bool:
        """Whether a call of a warm key could skip the guard tree now (`may_skip` but for the key)."""
        return quiet and not self.model.training and self.supported and os.environ.get(ENV, "1") != "0"

    @staticmethod
    def lasting(key: Hashable) -> Hashable:
        """`key` without this process's registration count: the kind of call as another process sees it."""
        spec, kind, autocast, inference, _registrations, settings = key
        return spec, kind, autocast, inference, settings

    def ran(self, key: Hashable, skipped: bool, compiled: bool, *, ran_graph: bool = True) -> None:
        """Note a call of `key`: guarded, compiling nothing and running a compiled graph, it warms the key; compiling,
        or running none (dynamo fell back to running the frame eagerly: past its recompile limit), it cools it."""
        if compiled or not ran_graph:
            self.warm.discard(key)
        elif not skipped:
            self.warm.add(key)

    def stance(self, skip: bool):
        """The context a call runs in: dynamo's current stance, with only its differentiating guards when `skip`."""
        if not skip:
            return contextlib.nullcontext()
        now = torch._dynamo.eval_frame._stance  # the caller's stance ("default", "eager_on_recompile"...) is kept
        return torch.compiler.set_stance(now.stance, skip_guard_eval_unsafe=True, force_backend=now.backend)


def _leaf(x: Any) -> Hashable:
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.dtype, x.device, x.requires_grad
    if isinstance(x, _PLAIN):
        return x
    layers = getattr(x, "layers", None)  # a transformers cache: its class, each layer's length and whether it is set up
    if layers is not None:
        return type(x).__name__, tuple(
            (type(layer).__name__, getattr(layer, "max_cache_len", None), getattr(layer, "is_initialized", None))
            for layer in layers)
    return type(x).__name__
