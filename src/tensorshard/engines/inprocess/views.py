"""Views of an in-process split model: a submodule of every shard, run as a split model of its own.

    encoder = split.view("model.encoder")      # a TensorParallel running model.encoder of every shard
    encoder(input_ids=ids)                     # on every device at once, as the split model runs its shards

A view shares its model's parameters, devices, workers and collectives (every attribute of the engine, by
reference: calls to a view and to its model must not overlap). It owns only what depends on where it sits:
its shards (the submodule of each device's shard), the splits and plan records of the tensors below it
(named relative to it), and the hooks that gather ZeRO-3 pieces and route partial gradients when it is
called directly rather than inside its model's call.

The split model it was made from (its root; a view of a view has the same root) keeps the truth. Adapters
added after splitting (engines/late_modules.py) are adopted by the root alone, whichever of the two is called first,
and a view then derives its bookkeeping from the root's again (`follow_root`). A view that adopted on its own
would see PEFT's wrappers as new under the names it knew, and adopt them a second time: device 0's values
copied over tensors ZeRO-3 had partitioned, the styles attached twice (every collective twice), the new
tensors partitioned again.
"""

from __future__ import annotations

import weakref
from typing import Sequence

from torch import nn

from ...registrations import count_modules_and_tensors

# Not copied from the model a view is made from: derived from the root for the view's own place (follow_root),
# or the model's own (a `forward` set on a transformers view of an encoder, say).
_DERIVED = frozenset({"splits", "zero_splits", "_layout_modules", "_module_names", "_module_count", "_dropout",
                      "_followed", "forward"})


def make_view(model: nn.Module, path: str, cls: type, parts: Sequence[nn.Module] | None = None) -> nn.Module:
    """A `cls` (TensorParallel, passed in: engine.py imports this file) running submodule `path` of every shard
    of `model` (a split model or a view), or `parts` (one module per device standing for that submodule: a
    method of it, say)."""
    if parts is None:
        try:
            parts = [shard.get_submodule(path) for shard in model.module_shards]
        except AttributeError as e:
            raise ValueError(f"view({path!r}): the split model has no submodule {path!r} ({e})") from None
    view = cls.__new__(cls)
    nn.Module.__init__(view)
    own = set(view.__dict__) | _DERIVED  # nn.Module's bookkeeping and the derived: the view's own
    view.__dict__.update({k: v for k, v in model.__dict__.items() if k not in own})  # the rest: shared
    root = root_of(model)
    above = model.__dict__.get("_root_path", "") if root is not model else ""
    # weakly (a view may be cached on its root) and not as a submodule (no nn.Module setattr)
    view.__dict__["_root_model"] = weakref.ref(root)
    view.__dict__["_root_path"] = f"{above}.{path}".strip(".")
    view.module_shards = nn.ModuleList(parts)
    view.training = parts[0].training
    follow_root(view)
    return view


def root_of(model: nn.Module) -> nn.Module:
    """The split model `model` is a view of; `model` itself when it is no view (or outlived that model, which
    leaves it the only one running those modules)."""
    ref = model.__dict__.get("_root_model")
    root = ref() if ref is not None else None
    return model if root is None else root


def follow_root(view: nn.Module) -> None:
    """Derive the view's bookkeeping from its root's again, when the root's changed since the last look
    (adapters adopted, ZeRO-3 applied; each rebinds what it changes): its splits, ZeRO-3 splits and plan records
    below the view's path, its module census, the root's dropout masks, and hooks on the view's modules that
    gather every partitioned parameter and route partial gradients. Cheap when nothing changed; nothing to do
    for a split model that is no view."""
    root = root_of(view)
    if root is view:
        return
    zero = root.__dict__.get("zero_splits")
    state = root.__dict__.get("_zero")
    sources = (root.splits, zero, root._layout_modules, root._dropout, state)
    followed = view.__dict__.get("_followed")
    if followed is not None and all(a is b for a, b in zip(followed, sources)):
        return
    # Into the view's __dict__: a transformers view's own __setattr__ would set a new name on every device's copy.
    own, path = view.__dict__, view.__dict__["_root_path"]
    own["splits"] = _below(root.splits, path)
    if zero:
        own["zero_splits"] = _below(zero, path)
    own["_layout_modules"] = _below(root._layout_modules, path)
    parts = list(view.module_shards)
    own["_module_names"] = {n for n, _ in parts[0].named_modules()}
    own["_module_count"] = count_modules_and_tensors(parts[0])
    own["_dropout"] = root._dropout  # made at the first adoption of adapters with dropout
    if state is not None:  # the view's calls gather ZeRO-3 pieces too (inside the root's call: gathered already)
        roots = list(root.module_shards)
        for rank, part in enumerate(parts):
            if not any(part is shard for shard in roots):
                state.hook_view(part, rank)
    partial = getattr(view._group, "partial_grads", None)
    if partial is not None:
        partial.install(parts)  # idempotent; a view's module inside the root's call routes once
    own["_followed"] = sources


def _below(names: dict, path: str) -> dict:
    """The entries of `names` (keyed by the root's names) at or below `path`, keyed relative to it."""
    if not path:
        return dict(names)
    prefix = f"{path}."
    return {("" if k == path else k[len(prefix):]): v for k, v in names.items() if k == path or k.startswith(prefix)}
