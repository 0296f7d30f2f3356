"""Views of a split transformers model: its parts, run on every device at once.

    encoder = split.get_encoder()                 # a view of the encoder of every shard (T5's generate runs it)
    split.model.layers[0].self_attn               # submodules by attribute, index or key: views too
    split.model.get_image_features(pixel_values)  # a method of a submodule: on every shard at once
    split.model.rope_deltas = None                # set on every device's copy (or refused)

Each is a `TensorParallel.view` (engines/inprocess/views.py) of the split model, sharing its shards, devices
and collectives: calls to a view and to its model must not overlap. ``get_input_embeddings()``,
``get_output_embeddings()``, ``get_encoder()`` and ``get_decoder()`` return plain views that keep the
submodule's call signature (`part_view`); ``split.model`` and the submodules below it are `SubmoduleView`s
(`submodule_view`), which also read other attributes from the first device's copy and set them on every
device's copy (engines/inprocess/shard_attributes.py); a model method that runs split towers (a VLM's
``get_image_features``) runs through a view whose shards call that method (`on_every_shard`). Views are
cached on the model or view they come from.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from ...engines.inprocess import TensorParallel
from ...engines.inprocess.shard_attributes import set_everywhere
from ...engines.inprocess.views import make_view


def part_view(model: TensorParallel, pick) -> nn.Module | None:
    """A TensorParallel view running the submodule `pick` returns (``get_encoder()``, ``get_input_embeddings()``),
    on every device at once; cached on `model`, None where `pick` returns None, `model` where it returns the model."""
    shard = model.module_shards[0]
    target = pick(shard)
    if target is None:
        return None
    if target is shard:
        return model
    path = next((n for n, m in shard.named_modules() if m is target), None)
    if path is None:
        raise RuntimeError(f"{type(target).__name__} returned by the model is not one of its submodules")
    if path not in model._views:
        view = model.view(path)
        run = view.forward

        def forward(*args, **kwargs):
            return run(*args, **kwargs)

        forward.__signature__ = inspect.signature(target.forward)  # generate inspects the encoder's
        view.forward = forward
        model._views[path] = view
    return model._views[path]


def on_every_shard(method: str, original):
    """A model method that runs split towers (a VLM's vision tower and projector): called on every shard at
    once, through the engine, like forward; the result of the output device."""

    def run(self, *args, **kwargs):
        return method_view(self, method)(*args, **kwargs)

    run.__signature__ = inspect.signature(original)  # generate picks the arguments by these names
    run.__name__ = method
    return run


class _CallMethod(nn.Module):
    """Holds one shard; its forward is one of the shard's methods (for `method_view`)."""

    def __init__(self, shard: nn.Module, method: str) -> None:
        super().__init__()
        self.shard, self.method = shard, method
        self.training = shard.training  # the view's mode (not train(): that would set every module of the shard)

    def forward(self, *args, **kwargs):
        return getattr(self.shard, self.method)(*args, **kwargs)


class SubmoduleView(TensorParallel):
    """``split.model.encoder``, ``split.model.layers[0]``: calling it runs that submodule on every device (a
    `TensorParallel.view`); its submodules are views too (by attribute, index or key, and when iterated), its
    methods run on every device as well (``split.model.get_image_features``, which generate calls), and its
    other attributes (a convolution's stride, a config) are read from the first device's copy, as generation
    code reads them (Whisper's reads its encoder's strides). Setting one sets every device's copy, or is
    refused (engines/inprocess/shard_attributes.py)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            first = self.module_shards[0]
            local = getattr(first, name)
            if isinstance(local, nn.Module) and name in first._modules:
                return submodule_view(self, name)
            if inspect.ismethod(local) and local.__self__ is first:
                return functools.partial(on_every_shard(name, getattr(type(first), name)), self)
            return local

    def __setattr__(self, name: str, value: Any) -> None:
        # Reads come from the first device's copy, so a write goes to every device's copy (generation code
        # resets state such as Qwen2-VL's `model.rope_deltas` this way); kept on the view, it would reach no
        # shard and their state would go stale silently. The view's own state: the engine's attributes.
        if name.startswith("_") or name in ("training", "module_shards") or name in self.__dict__:
            super().__setattr__(name, value)
            return
        set_everywhere(self.module_shards, self._placement, self.splits, name, value, self.__dict__.get("_path", ""))

    # A container (ModuleList, Sequential, ModuleDict) reads like one: split.model.layers[0], len(), for ... in
    def __getitem__(self, key: Any) -> Any:
        first = self.module_shards[0]
        if isinstance(first, nn.ModuleDict):
            if key not in first._modules:
                raise KeyError(key)
            return submodule_view(self, key)
        names = self._child_names()
        if isinstance(key, slice):
            return [submodule_view(self, n) for n in names[key]]
        return submodule_view(self, names[key])  # IndexError / TypeError as a list of them raises

    def __len__(self) -> int:
        return len(self._child_names())

    def __iter__(self):
        if isinstance(self.module_shards[0], nn.ModuleDict):
            return iter(list(self.module_shards[0]._modules))  # the keys, as a ModuleDict iterates
        return iter([submodule_view(self, n) for n in self._child_names()])

    def __bool__(self) -> bool:
        return not isinstance(self.module_shards[0], _CONTAINERS) or len(self) > 0

    def _child_names(self) -> list[str]:
        first = self.module_shards[0]
        if not isinstance(first, _CONTAINERS):
            raise TypeError(f"{type(first).__name__} (a view of it in the split model) is not a container of modules")
        return list(first._modules)


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def top_level_tensor(split: nn.Module, name: str) -> torch.Tensor:
    """A parameter or buffer the model holds itself (BLIP-2's ``query_tokens``), read by the model's own
    methods that generate calls on the split model (``get_image_features``): the first device's copy. Only
    without gradients: a computation outside the shards' forward would give that copy alone a gradient."""
    if torch.is_grad_enabled():
        raise AttributeError(
            f"{name} is a parameter of every device's copy of the split {type(split._original).__name__}; code "
            "outside its forward reads it only under torch.no_grad() (generate does). Call the split model itself "
            "to compute with gradients."
        )
    return getattr(split.module_shards[0], name)


def method_view(model: TensorParallel, method: str) -> TensorParallel:
    """A view of `model` whose shards run `method` of its shards (cached on `model`)."""
    views = _own_cache(model, "_method_views")
    if method not in views:
        views[method] = make_view(model, "", TensorParallel, parts=[_CallMethod(shard, method) for shard in model.module_shards])
    return views[method]


def submodule_view(model: TensorParallel, name: str) -> "SubmoduleView":
    """A view running child `name` of every shard of `model` (cached on `model`)."""
    views = _own_cache(model, "_submodule_views")
    if name not in views:
        view = model.view(name)
        for key in model.__dict__.get("_adopted", ()):  # the model's own attributes: not this submodule's
            view.__dict__.pop(key, None)
        view.__dict__["_adopted"] = frozenset()
        parent = model.__dict__.get("_path", "") if isinstance(model, SubmoduleView) else ""
        view.__dict__["_path"] = f"{parent}.{name}" if parent else name
        view.__class__ = SubmoduleView
        views[name] = view
    return views[name]


def _own_cache(model: TensorParallel, key: str) -> dict:
    """A dict of `model`'s own: a view starts with a copy of its model's attributes, caches included."""
    owner = model.__dict__.get(f"{key}_owner")
    if owner is not model:
        model.__dict__[key] = {}
        model.__dict__[f"{key}_owner"] = model
    return model.__dict__[key]
