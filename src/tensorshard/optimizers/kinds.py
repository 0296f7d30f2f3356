"""What an optimizer's update reads, by class: the registry that decides how a split weight is stepped.

A split weight reaches the optimizer as one slice per device. Whether that changes the result depends on
what the update of one entry reads:

- ``ELEMENTWISE``: that entry's own values only (SGD, Adam, AdamW, ...). A slice steps exactly like the
  same entries of the whole tensor: nothing to do.
- ``PER_TENSOR``: the whole tensor it belongs to, and nothing else (Muon orthogonalizes the whole matrix;
  Adafactor averages second moments over rows and columns and scales by the tensor's RMS). tensorshard steps
  such a tensor whole (whole.py) and each device keeps its slice; its state must be shaped like the tensor,
  like it with some dimensions reduced to 1 (Adafactor's row and column moments), or scalars.
- ``REFUSED``: something tensorshard cannot rebuild from whole tensors (LBFGS flattens every parameter into
  one vector; bitsandbytes' LAMB and LARS compute their per-tensor trust ratio inside their own kernels over
  the flattened slice). A split weight in such an optimizer is refused before its first step.

A class is looked up along its MRO, stopping at the first class that is registered or that defines its own
``step``: a subclass that only changes ``__init__`` is its parent's kind, one that overrides ``step`` is
unknown until registered. An unknown step under a per-tensor or refused parent is refused (its step could do
anything with the slice); any other unknown class is assumed elementwise, with one warning per class that
names the assumption and `register_elementwise` / `register_per_tensor`, which state it.

A wrapper that hands its step to the optimizer it wraps (accelerate's ``AcceleratedOptimizer``, which
transformers' Trainer uses; Lightning's and Fabric's optimizer wrappers, subclasses of the wrapped class with a
``step`` of their own) is of the kind of the optimizer inside: `inner_optimizer` finds it, as the optimizer held
in one of the wrapper's attributes whose ``param_groups`` are the wrapper's own (the same list).

    import tensorshard as tp
    tp.optimizers.register_elementwise(MyAdam)      # its update of an entry reads that entry only
    tp.optimizers.register_per_tensor(MyShampoo)    # ... reads its whole tensor: step split tensors whole
"""

from __future__ import annotations

import warnings

import torch

from ..logs import get_logger

logger = get_logger(__name__)

ELEMENTWISE, PER_TENSOR, REFUSED = "elementwise", "per-tensor", "refused"

_TORCH_ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop",
                      "ASGD", "SparseAdam")
_REFUSED_WHY = {
    "torch.optim.lbfgs.LBFGS": "its step treats all parameters as one flat vector (and re-evaluates the closure)",
}
# Named, not imported: bitsandbytes is optional and slow to import. Their step (Optimizer8bit's) computes the
# trust ratio ||p|| / ||update|| in its kernels over whatever tensor it is given: the device's slice.
for _name in ("lamb.LAMB", "lamb.LAMB8bit", "lamb.LAMB32bit", "lars.LARS", "lars.LARS8bit", "lars.LARS32bit",
              "lars.PytorchLARS"):
    _REFUSED_WHY[f"bitsandbytes.optim.{_name}"] = (
        "its per-tensor trust ratio (||weight|| / ||update||) is computed inside bitsandbytes' own step over the "
        "slice a device holds"
    )

_kinds: dict[str, str] = {}
_warned: set[str] = set()


def _key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _register(cls: type, kind: str) -> type:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register an optimizer class (a torch.optim.Optimizer subclass); got {cls!r}")
    _kinds[_key(cls)] = kind
    return cls


def register_elementwise(cls: type) -> type:
    """State that `cls` updates every entry of a parameter from that entry's own values (gradient, state),
    as AdamW does: a split weight's slices then step as they are. Usable as a class decorator."""
    return _register(cls, ELEMENTWISE)


def register_per_tensor(cls: type) -> type:
    """State that `cls` updates each parameter from that whole parameter alone (its gradient, its state:
    shaped like it, like it with dimensions reduced to 1, or scalars), as Muon does: tensorshard then steps
    every split weight whole, each device keeping its slice. Usable as a class decorator."""
    return _register(cls, PER_TENSOR)


def _register_builtins() -> None:
    for name in _TORCH_ELEMENTWISE:
        if hasattr(torch.optim, name):
            register_elementwise(getattr(torch.optim, name))
    for name in ("Muon", "Adafactor"):  # the newer ones are absent from older torch releases
        if hasattr(torch.optim, name):
            register_per_tensor(getattr(torch.optim, name))
    for key in _REFUSED_WHY:
        _kinds[key] = REFUSED


_register_builtins()


def _lookup(cls: type) -> tuple[str | None, list[type]]:
    """(the registered kind that applies to `cls`, or None; the unregistered classes with a step of their own
    met before it, most derived first)."""
    overriding = []
    for klass in cls.__mro__:
        kind = _kinds.get(_key(klass))
        if kind is not None:
            return kind, overriding
        if klass is torch.optim.Optimizer:
            break
        if "step" in klass.__dict__:
            overriding.append(klass)
    return None, overriding


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The optimizer a wrapper hands its step to: one held in an attribute of `optimizer` with the very same
    ``param_groups`` (accelerate's ``.optimizer``, Lightning's and Fabric's ``._optimizer``); None if there is none."""
    try:
        groups = optimizer.param_groups
    except AttributeError:
        return None
    for value in vars(optimizer).values():
        if isinstance(value, torch.optim.Optimizer) and value is not optimizer and value.param_groups is groups:
            return value
    return None


def kind_of(optimizer: torch.optim.Optimizer) -> str:
    """ELEMENTWISE, PER_TENSOR or REFUSED for this optimizer (a wrapper: the kind of the one inside; an unknown
    class: ELEMENTWISE, warned once)."""
    cls = type(optimizer)
    kind, overriding = _lookup(cls)
    if not overriding:
        return kind if kind is not None else ELEMENTWISE
    inner = inner_optimizer(optimizer)
    if inner is not None:
        return kind_of(inner)  # its step is the inner one's: nothing to assume
    if kind in (PER_TENSOR, REFUSED):
        return REFUSED  # an override of a step that needs whole tensors: nothing says what it reads
    if _key(cls) not in _warned:
        _warned.add(_key(cls))
        warnings.warn(
            f"tensorshard assumes {_key(cls)} is elementwise: its update of an entry reads only that entry's "
            f"gradient and state, so each device steps the slice of a split weight it holds. If its step reads a "
            "whole tensor (an orthogonalization, a norm, factored moments), state it with "
            "tp.optimizers.register_per_tensor(cls) to step split weights whole; confirm the assumption with "
            "tp.optimizers.register_elementwise(cls) to silence this warning.",
            UserWarning,
            stacklevel=5,
        )
    return ELEMENTWISE


def why_refused(optimizer: torch.optim.Optimizer) -> str:
    """Why `optimizer` (of kind REFUSED) cannot step a split weight exactly."""
    cls = type(optimizer)
    kind, overriding = _lookup(cls)
    inner = inner_optimizer(optimizer) if overriding else None
    if inner is not None:
        return why_refused(inner)
    if overriding:
        parent = next(klass for klass in cls.__mro__ if _key(klass) in _kinds)
        return (f"{cls.__qualname__} overrides step() of {_key(parent)} ({kind}), and nothing says what the override "
                "reads: on a split weight it would see one device's slice. If it updates each weight from that "
                "weight alone, state so with tp.optimizers.register_per_tensor(cls)")
    for klass in cls.__mro__:
        if _key(klass) in _REFUSED_WHY:
            return _REFUSED_WHY[_key(klass)]
    return f"{_key(cls)} is registered as refused"
