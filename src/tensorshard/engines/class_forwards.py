"""While dynamo traces a split model's decode step: the modules whose forward a style replaced, called the way dynamo
traces cheaply.

    from tensorshard.engines.class_forwards import class_forwards
    with class_forwards(shards):
        out = compiled_capture(**kwargs)    # dynamo inlines each wrapped layer's forward, not nn.Module's call

A style wraps a split layer by giving the instance its own `forward` (styles/style.py `wrap_forward`: a closure
over the layer's slice, comm and name). Dynamo calls a module straight through its class's `forward` only when the
instance has none of its own (and no hooks); otherwise it traces nn.Module's `__call__` machinery line by line
(`_wrapped_call_impl`, `_call_impl`: its hook dictionaries, global hooks, forward-call selection). For SmolLM2's
shape that was 12,600 of the ~80,700 bytecodes dynamo traced per shard at 2 devices (210 wrapped layers; the
unsplit model traces none of it, 51,800 bytecodes in all; the styles' and collectives' own code is ~15,000 more).

Inside `class_forwards(modules)` each module holding an instance forward is an instance of a subclass of its own
class (made once per class and kept: `ClassForward`, same name and module) whose class `forward` calls the
instance's forward, kept meanwhile under `_instance_forward`; dynamo then takes its short way and inlines that
one-line forward. What runs is the same function with the same arguments: the numbers and the graph are the same.
Everything is put back on exit, also after an error; a class Python will not subclass so is left as it is.

Only for calls whose dynamo guards are never evaluated without it: dynamo guards the module classes it traced, so
a compiled frame traced inside and called outside would compile again (under torchrun's guard-skipping stance it
stops: "Recompilation triggered with skip_guard_eval_unsafe stance"). The in-process engine's captured decode
steps qualify (engines/inprocess/stitched_decode.py: both capturing calls run inside, and the stitched or parallel
step built from them runs no dynamo frame). So does the torchrun engine's compiled step on CPU ranks, where every
call dynamo runs is inside (engines/torchrun/decoding.py) and later tokens call the graph directly, without dynamo
(direct_step.py); where dynamo runs every token (GPU ranks, ``TENSORSHARD_DIRECT_STEP=0``) it is not used: a swap
per token costs ~1.4 ms for SmolLM2's 210 split layers.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator

from torch import nn

_KEPT = "_instance_forward"  # where an instance's own forward waits while its class's forward calls it
_subclasses: dict[type, type | None] = {}  # class -> its ClassForward subclass (one per class: dynamo guards on it)


class ClassForward:
    """Mixed into a layer's class inside `class_forwards`: the class forward that calls the instance's own."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, _KEPT)(*args, **kwargs)


def subclass_of(cls: type) -> type | None:
    """`cls` with `ClassForward`'s forward first (made once per class; named as `cls`, so logs and reprs read
    the same), or None where Python refuses such a subclass (a metaclass of its own, say)."""
    if cls not in _subclasses:
        try:
            made = type(cls)(cls.__name__, (ClassForward, cls), {"__module__": cls.__module__,
                                                                "__qualname__": cls.__qualname__})
        except TypeError:
            made = None
        _subclasses.setdefault(cls, made)  # (two threads making one: both keep the first, which dynamo saw)
    return _subclasses[cls]


@contextmanager
def class_forwards(roots: Iterable[nn.Module]) -> Iterator[int]:
    """For the duration: every module under `roots` whose instance has its own callable `forward` calls it through
    its class's forward (see the module doc). Yields how many modules were changed."""
    changed: list[tuple[nn.Module, type, Any]] = []
    seen: set[int] = set()
    try:
        for root in roots:
            for module in root.modules():
                own = module.__dict__.get("forward")
                if id(module) in seen or not callable(own) or isinstance(module, ClassForward):
                    continue
                seen.add(id(module))
                cls = type(module)
                sub = subclass_of(cls)
                if sub is None:  # (traced as before)
                    continue
                try:
                    module.__class__ = sub
                except TypeError:  # an object layout Python will not reassign: traced as before
                    _subclasses[cls] = None
                    continue
                module.__dict__[_KEPT] = module.__dict__.pop("forward")
                changed.append((module, cls, own))
        yield len(changed)
    finally:
        for module, cls, own in reversed(changed):
            module.__class__ = cls
            module.__dict__.pop(_KEPT, None)
            module.__dict__["forward"] = own
