"""While dynamo traces a split model's decode step: the modules whose forward a style replaced (or transformers
wrapped), called the way dynamo traces cheaply. Entered through engines/cheap_tracing.py.

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

Three more changes of the same kind, each the same operators with the same arguments:
- without gradients at entry, a module whose style gave a shorter no-gradient forward (styles/style.py
  `wrap_forward`: a row layer's matmul and all-reduce without the checks an eager or training call needs; a
  column layer's is its class forward, then called directly, its instance forward set aside for the duration)
  calls that one instead;
- a module without a forward of its own whose class forward transformers wrapped (`deprecate_kwarg`, which only
  renames a deprecated keyword; `GradientCheckpointingLayer`, which only passes the call on for a layer that does
  not checkpoint) is an instance of a subclass calling past the wrappers (`unwrapped_class`; the wrapper itself
  where the call passes the deprecated keyword outside a trace, or would be refused); ~4,000 bytecodes per
  SmolLM2 shard;
- a plain `nn.ModuleList` is a `WholeSlices`, whose slice covering all of it is itself: transformers' models loop
  over `self.layers[: config.num_hidden_layers]`, a new ModuleList per call (~3,500 bytecodes of `add_module`).

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

import torch
from torch import nn

from ..styles.style import no_grad_chooser

try:  # (transformers is optional: without it no forward is wrapped by it)
    from transformers.modeling_layers import GradientCheckpointingLayer
    from transformers.utils.deprecation import deprecate_kwarg
except ImportError:  # pragma: no cover - transformers is installed with the project's extras
    GradientCheckpointingLayer = deprecate_kwarg = None

_KEPT = "_instance_forward"  # where an instance's own forward waits while its class's forward calls it
_subclasses: dict[type, type | None] = {}  # class -> its ClassForward subclass (one per class: dynamo guards on it)
_unwrapped: dict[type, type | None] = {}  # class -> its subclass calling past transformers' wrappers, or None
_made_unwrapped: set[type] = set()  # those subclasses


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


def _wrapper_codes() -> tuple[Any, Any]:
    """The code objects of transformers' `deprecate_kwarg` wrapper and of the forward `GradientCheckpointingLayer`
    wraps each subclass's forward in (None without transformers)."""
    if deprecate_kwarg is None:
        return None, None
    deprecation = deprecate_kwarg("old", "99.0", new_name="new")(lambda new=None: new).__code__
    layer = type("Probe", (GradientCheckpointingLayer,), {"forward": lambda self: None, "__module__": __name__})
    return deprecation, layer.forward.__code__


_DEPRECATION, _CHECKPOINTING = _wrapper_codes()


def _closure(fn: Any, code: Any) -> dict[str, Any] | None:
    """`fn`'s closure by name where its code is `code`, else None."""
    if code is None or getattr(fn, "__code__", None) is not code:
        return None
    return dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def deprecated_name(forward: Any) -> tuple[dict[str, Any], Any] | None:
    """(the wrapper's closure by name, the function it wraps) where `forward` is a `deprecate_kwarg` wrapper."""
    cells = _closure(forward, _DEPRECATION)
    if cells is None:
        return None
    old, inner = cells.get("old_name"), cells.get("func")
    return (cells, inner) if isinstance(old, str) and callable(inner) else None


def _checkpointed(forward: Any) -> Any:
    """The forward `GradientCheckpointingLayer`'s wrapper `forward` calls when the layer does not checkpoint, or None
    where `forward` is no such wrapper."""
    cells = _closure(forward, _CHECKPOINTING)
    inner = None if cells is None else cells.get("forward")
    return inner if callable(inner) else None


def _calling_past(wrapper: Any, inner: Any, cells: dict[str, Any] | None) -> Any:
    """A forward calling `inner` where `wrapper` would, with the arguments it would: where the call passes the
    deprecated keyword (`cells`: the deprecation wrapper's closure), renamed as the wrapper renames it while
    compiling (it warns only outside), or through the wrapper itself where it would refuse or warn."""
    old = cells["old_name"] if cells else None
    new = cells.get("new_name") if cells else None
    refuses = bool(cells) and bool(cells.get("is_greater_or_equal_version")) and bool(
        cells.get("raise_if_greater_or_equal_version"))
    renames = isinstance(new, str) and not refuses

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if old is not None and old in kwargs:
            if not renames or new in kwargs or not torch.compiler.is_compiling():
                return wrapper(self, *args, **kwargs)
            kwargs[new] = kwargs.pop(old)
        return inner(self, *args, **kwargs)

    forward.__wrapped__ = wrapper
    return forward


def unwrapped_class(cls: type) -> type | None:
    """`cls` with a forward that calls past transformers' wrappers around it (made once per class, named as `cls`):
    `deprecate_kwarg`'s when the call passes no deprecated keyword, and `GradientCheckpointingLayer`'s, which only
    passes the call on for a layer that does not checkpoint (`unwrapping` takes only those); None where its
    forward is neither."""
    if cls not in _unwrapped:
        wrapper = getattr(cls, "forward", None)
        inner = _checkpointed(wrapper) or wrapper
        found = deprecated_name(inner)
        made = None
        if found is not None or inner is not wrapper:
            cells, inner = found if found is not None else (None, inner)
            try:
                made = type(cls)(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
                # (set after: GradientCheckpointingLayer's __init_subclass__ would wrap it again)
                made.forward = _calling_past(wrapper, inner, cells)
            except TypeError:
                made = None
        if _unwrapped.setdefault(cls, made) is not None:
            _made_unwrapped.add(_unwrapped[cls])
    return _unwrapped[cls]


def unwrapping(module: nn.Module) -> type | None:
    """The class `module` takes while dynamo traces it (`unwrapped_class`), or None: where it has one, and where it
    will not checkpoint (read at every entry: a layer set to checkpoint goes through transformers' wrapper)."""
    sub = unwrapped_class(type(module))
    if sub is None or getattr(module, "gradient_checkpointing", False):
        return None
    return sub


class WholeSlices(nn.ModuleList):
    """A ModuleList whose slice covering all of it is itself: transformers' models loop over
    `self.layers[: config.num_hidden_layers]`, which builds a new ModuleList per call, registering each layer in it
    (nn.Module's `add_module` and every global registration hook: ~3,500 bytecodes per call of SmolLM2's shape).
    The same layers in the same order; only put in place while dynamo traces (`class_forwards`)."""

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice) and idx.step is None and not idx.start and (idx.stop is None or idx.stop >= len(self)):
            torch._C._log_api_usage_once("python.nn_module")  # (what the new list's __init__ does: a node in the graph)
            return self
        return super().__getitem__(idx)


WholeSlices.__name__ = WholeSlices.__qualname__ = "ModuleList"  # (as `ClassForward` keeps names: logs read the same)


def _lean(module: nn.Module, own: Any) -> Any:
    """A style's shorter forward for `module` (styles/style.py `wrap_forward`), where gradients are off now and the
    forward it stands for is still the module's own; else None."""
    choose = no_grad_chooser(module, own)
    if choose is None or torch.is_grad_enabled():
        return None
    return choose()


def _is_class_forward(fn: Any, module: nn.Module) -> bool:
    """`fn` is `module`'s class forward, bound to it (what dynamo calls anyway when the instance has no forward)."""
    return getattr(fn, "__self__", None) is module and getattr(fn, "__func__", None) is type(module).forward


@contextmanager
def class_forwards(roots: Iterable[nn.Module]) -> Iterator[int]:
    """For the duration: every module under `roots` whose instance has its own callable `forward` calls it through
    its class's forward, or is called as its class without gradients where its style says that is all its forward
    does then; every other module whose class forward transformers wrapped is called past the wrappers (see the
    module doc). Yields how many modules were changed."""
    changed: list[tuple[nn.Module, type, Any]] = []
    seen: set[int] = set()
    try:
        for root in roots:
            for module in root.modules():
                own = module.__dict__.get("forward")
                if id(module) in seen or isinstance(module, (ClassForward, WholeSlices)) or type(module) in _made_unwrapped:
                    continue
                seen.add(id(module))
                cls = type(module)
                if not callable(own):  # the class's forward: past transformers' wrappers where it has them
                    sub = WholeSlices if cls is nn.ModuleList else unwrapping(module)
                    if sub is not None:
                        try:
                            module.__class__ = sub
                        except TypeError:
                            if sub is not WholeSlices:
                                _unwrapped[cls] = None
                            continue
                        changed.append((module, cls, None))
                    continue
                lean = _lean(module, own)
                if _is_class_forward(lean, module):  # (no gradients: the instance forward only calls this)
                    del module.__dict__["forward"]
                    changed.append((module, cls, own))
                    continue
                sub = subclass_of(cls)
                if sub is None:  # (traced as before)
                    continue
                try:
                    module.__class__ = sub
                except TypeError:  # an object layout Python will not reassign: traced as before
                    _subclasses[cls] = None
                    continue
                module.__dict__[_KEPT] = module.__dict__.pop("forward") if lean is None else lean
                module.__dict__.pop("forward", None)
                changed.append((module, cls, own))
        yield len(changed)
    finally:
        for module, cls, own in reversed(changed):
            module.__class__ = cls
            if own is not None:
                module.__dict__.pop(_KEPT, None)
                module.__dict__["forward"] = own
