"""A transformers model output whose logits are gathered over the vocabulary when first read.

    out = model(input_ids=ids, labels=ids)    # torchrun: the loss came from vocabulary slices (causal_lm_loss.py)
    out.loss.backward()                       # no all-gather in a training step that reads only the loss
    out.logits                                # first read: one all-gather, then a plain (batch, seq, vocab) tensor

The output keeps its class's behaviour (attributes, ``out["logits"]``, ``out[1]``, ``to_tuple()``, ``items()``,
pytree flattening): each of these reads the gathered logits, and the first of them gathers. Until then the
object is an instance of a subclass made here, after it an instance of the model's own output class again.
The gather is a collective: every tensor-parallel rank must read the logits (any value of the output), or
none. The gather is differentiable as the head's own gather was: backward through the logits reaches the head.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_GATHER = "_tensorshard_gather_logits"  # instance attribute: the pending gather
_READERS = ("get", "items", "values", "to_tuple", "copy", "pop", "setdefault", "update")
_lazy_classes: dict[type, type] = {}


def gather_logits_on_read(out: Any, gather: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Make `out` (a ModelOutput holding vocabulary-sliced ``logits``) call `gather` on them when first read."""
    cls = type(out)
    if cls not in _lazy_classes:
        _lazy_classes[cls] = _lazy_class(cls)
    object.__setattr__(out, _GATHER, gather)  # not ModelOutput.__setattr__: no new key
    object.__setattr__(out, "__class__", _lazy_classes[cls])
    return out


def _materialize(out: Any, cls: type) -> None:
    state = object.__getattribute__(out, "__dict__")
    gather = state.pop(_GATHER, None)
    object.__setattr__(out, "__class__", cls)  # a plain output from now on, whatever the gather does
    if gather is None:
        return
    local = state["logits"]
    try:
        with torch.set_grad_enabled(local.requires_grad):  # as if gathered in the forward
            full = gather(local)
    except BaseException:
        out.logits = None  # never the slice: it would read as wrong logits
        raise
    out.logits = full  # ModelOutput.__setattr__: the attribute and the key


def _lazy_class(cls: type) -> type:
    def __getattribute__(self, name):
        if name == "logits" or name in _READERS:
            _materialize(self, cls)
        return object.__getattribute__(self, name)

    def reading(method: str):
        def run(self, *args, **kwargs):
            _materialize(self, cls)
            return getattr(cls, method)(self, *args, **kwargs)

        run.__name__ = method
        return run

    def __repr__(self) -> str:
        keys = ", ".join(k for k in cls.keys(self) if k != "logits")
        return f"{cls.__name__}({keys}, logits: gathered on first read)"

    namespace = {"__getattribute__": __getattribute__, "__repr__": __repr__, "__module__": cls.__module__,
                 "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    for method in ("__getitem__", "__eq__", "__ne__", "__reduce__", "__reduce_ex__", "__copy__", "__deepcopy__", "__or__"):
        if hasattr(cls, method):
            namespace[method] = reading(method)
    return type(cls.__name__, (cls,), namespace)
