"""A split transformers model that is still a transformers model.

    model = AutoModelForCausalLM.from_pretrained(...)
    model = tp.tensor_parallel(model, ["cuda:0", "cuda:1"])      # an instance of TensorParallelLlamaForCausalLM
    out = model.generate(input_ids, max_new_tokens=50)           # transformers' own generate
    model(input_ids=ids, labels=ids).loss.backward()
    model.save_pretrained("out/")                                # an unsplit checkpoint

`tensor_parallel()` returns, for a `PreTrainedModel`, an instance of a class made on the fly that inherits
both `TensorParallel` (the engine: shards, forward) and the model's own class (``LlamaForCausalLM``: its
``generate``, ``prepare_inputs_for_generation``, ``can_generate``, class attributes...). The model's
constructor never runs: the instance takes the original's ``config``, ``generation_config`` and other plain
attributes, and its ``forward`` (with the model's own signature, which ``generate`` inspects) runs the
shards. The configuration objects are the ones every shard reads (engines/shared_config.py): a field set on
``split.config`` reaches every device. What differs from the unsplit model:

- the KV cache is sharded: each device caches its own heads (cache.py); a cache filled by the unsplit
  model is divided by heads on first use (unsplit_cache.py); a cache class of the model's own that is not a
  transformers `Cache` (Reformer's) gets one copy per device, and is refused when filled elsewhere;
- ``get_input_embeddings()``, ``get_output_embeddings()``, ``get_encoder()`` return views that run that part
  of every shard (T5's ``generate`` runs the encoder through one); a multimodal model's
  ``get_image_features()`` (``_video_``, ``_audio_``) runs on every shard at once (``generate`` encodes the
  images through it before the first token);
- ``save_pretrained`` gathers the unsplit weights (on the CPU, one tensor at a time, then the whole state
  dict: peak host memory is one full copy of the model) and writes them with transformers' own
  ``save_pretrained`` of the original class, into a temporary folder moved into place;
- ``state_dict()`` is the shards' (use ``tp.save_tensor_parallel`` for the unsplit one); submodules such
  as ``model.model`` live in ``model.module_shards[r]``; ``split.model.encoder`` (``split.model.layers[0]``) is
  a view that runs that submodule on every device, reads its other attributes from the first device's copy
  and sets them on every device's copy, or refuses (engines/inprocess/shard_attributes.py);
- gradient (activation) checkpointing, enabled before or after splitting, recomputes each block in its
  shard's own backward pass (engines/inprocess/shard_backward.py); not in debug mode on a GPU;
- unsupported, with an error saying so: output_attentions, static caches, resizing embeddings;
- training with dropout: replicated activations get one mask on every device (comm/dropout.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from ...checkpoint.atomic import write_into_folder
from ...checkpoint.gather import WEIGHT_FILES, gathered_state_dict, save_pretrained_options
from ...engines.inprocess import TensorParallel
from ...engines.inprocess.shard_attributes import set_everywhere
from ...engines.inprocess.views import make_view
from ...layers import is_transformers_model
from .adapters import SplitAdapters
from .cache import shard_cache
from .unsplit_cache import split_filled_cache

logger = logging.getLogger(__name__)

_NOT_COPIED = {"hf_device_map", "_hf_hook"}  # accelerate dispatch state of the original: meaningless here


def tensor_parallel_pretrained(module: nn.Module, device_ids=None, **kwargs) -> "TransformersTensorParallel":
    """Split a transformers model; the result is also an instance of the model's class (see module doc)."""
    return split_class(type(module))(module, device_ids, **kwargs)


@functools.lru_cache(maxsize=None)
def split_class(model_class: type) -> type:
    """``TensorParallel<ModelClass>``: the engine first in the MRO, then the model's own class."""

    def forward(self, *args, **kwargs):
        return TransformersTensorParallel.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(model_class.forward)  # generate() inspects the argument names
    forward.__doc__ = model_class.forward.__doc__
    name = f"TensorParallel{model_class.__name__}"
    methods = {"forward": forward, "__module__": __name__}
    for method in _ENCODER_METHODS:
        if callable(getattr(model_class, method, None)):
            methods[method] = _on_every_shard(method, getattr(model_class, method))
    return type(name, (SplitAdapters, TransformersTensorParallel, model_class), methods)  # adapters.py: add/load_adapter


_ENCODER_METHODS = ("get_image_features", "get_video_features", "get_audio_features")


def _on_every_shard(method: str, original):
    """A model method that runs split towers (a VLM's vision tower and projector): called on every shard at
    once, through the engine, like forward; the result of the output device."""

    def run(self, *args, **kwargs):
        return _method_view(self, method)(*args, **kwargs)

    run.__signature__ = inspect.signature(original)  # generate picks the arguments by these names
    run.__name__ = method
    return run


class _CallMethod(nn.Module):
    """Holds one shard; its forward is one of the shard's methods (for `_method_view`)."""

    def __init__(self, shard: nn.Module, method: str) -> None:
        super().__init__()
        self.shard, self.method = shard, method
        self.training = shard.training  # the view's mode (not train(): that would set every module of the shard)

    def forward(self, *args, **kwargs):
        return getattr(self.shard, self.method)(*args, **kwargs)


def transformers_view(model: TensorParallel, path: str, original: nn.Module) -> "TransformersTensorParallel":
    """The transformers model at `path` inside a split wrapper (a PeftModel, your own module), as a split model
    of its own class that runs that submodule of every shard: its ``generate``, ``save_pretrained`` and
    per-device KV cache, exactly as if it had been split on its own. Shares the wrapper's shards and engine;
    calls to the two must not overlap. `original` is the (consumed) unsplit model at `path`."""
    view = model.view(path)
    view.__class__ = split_class(type(original))
    _adopt(view, original)
    view.training = original.training
    return view


def _adopt(model: "TransformersTensorParallel", original: nn.Module) -> None:
    """Give the split model the unsplit one's plain attributes (config, generation_config, ...) and state."""
    adopted = []
    for key, value in vars(original).items():  # config, generation_config, name_or_path, ...
        if key not in vars(nn.Module()) and key not in _NOT_COPIED and key not in model.__dict__:
            object.__setattr__(model, key, value)
            adopted.append(key)
    object.__setattr__(model, "_adopted", frozenset(adopted))  # the model's own attributes (__setattr__)
    object.__setattr__(model, "_original", original)  # consumed (on meta); not a submodule
    object.__setattr__(model, "_views", {})
    object.__setattr__(model, "_forward_parameters", dict(inspect.signature(type(original).forward).parameters))


class TransformersTensorParallel(TensorParallel):
    """The engine side of a split transformers model; instances come from `split_class(...)`."""

    def __init__(self, module: nn.Module, device_ids=None, **kwargs) -> None:
        if not is_transformers_model(module):
            raise TypeError(f"expected a transformers PreTrainedModel, got {type(module).__name__}")
        training = module.training
        super().__init__(module, device_ids, **kwargs)
        _adopt(self, module)
        self.training = training  # the shards keep the original's per-module modes
        _align_experts(self)

    # -- running -----------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        kwargs = self._keywords(args, kwargs)
        if kwargs.get("output_attentions") or getattr(self.config, "output_attentions", False):
            raise NotImplementedError(
                "output_attentions=True: each device computes the attention weights of its own heads only, and "
                "a split model does not gather them; call without output_attentions"
            )
        for key, value in kwargs.items():  # any cache argument: past_key_values, Mamba's cache_params, ...
            if isinstance(value, Cache) or (key == "past_key_values" and value is not None):
                # (past_key_values: refuses legacy tuples; one filled by the unsplit model is divided by heads)
                kwargs[key] = shard_cache(value, self.world_size, functools.partial(split_filled_cache, model=self))
        return super().forward(**kwargs)  # caches the shards build are joined into one (cache.py)

    def _keywords(self, args: tuple, kwargs: dict) -> dict:
        """Positional arguments as keywords, named as in the model's forward."""
        if not args:
            return kwargs
        names = [n for n, p in self._forward_parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD][1:]
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}.forward takes at most {len(names)} positional arguments ({len(args)} given)")
        clash = [n for n in names[: len(args)] if n in kwargs]
        if clash:
            raise TypeError(f"{type(self).__name__}.forward got multiple values for {clash}")
        return {**dict(zip(names, args)), **kwargs}

    # -- what transformers code asks of a model ------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where outputs land (generate creates its tensors there)."""
        return self.output_device

    def get_input_embeddings(self) -> nn.Module:
        return self._view_of(lambda m: m.get_input_embeddings())

    def get_output_embeddings(self) -> nn.Module | None:
        return self._view_of(lambda m: m.get_output_embeddings())

    def get_encoder(self, *args, **kwargs) -> nn.Module:
        return self._view_of(lambda m: m.get_encoder(*args, **kwargs))

    def get_decoder(self, *args, **kwargs) -> nn.Module:
        return self._view_of(lambda m: m.get_decoder(*args, **kwargs))

    def _view_of(self, pick) -> nn.Module | None:
        """A TensorParallel view running the submodule `pick` returns, on every device at once."""
        shard = self.module_shards[0]
        target = pick(shard)
        if target is None:
            return None
        if target is shard:
            return self
        path = next((n for n, m in shard.named_modules() if m is target), None)
        if path is None:
            raise RuntimeError(f"{type(target).__name__} returned by the model is not one of its submodules")
        if path not in self._views:
            view = self.view(path)
            run = view.forward

            def forward(*args, **kwargs):
                return run(*args, **kwargs)

            forward.__signature__ = inspect.signature(target.forward)  # generate inspects the encoder's
            view.forward = forward
            self._views[path] = view
        return self._views[path]

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """Write an unsplit checkpoint that ``from_pretrained`` loads into a plain model.

        The weights are gathered to the CPU (peak host memory: one full copy of the model) and written by
        the original class's ``save_pretrained`` (same files, config and generation config as an unsplit
        save) into a temporary folder next to `save_directory`, whose files are then moved into it.
        """
        kwargs, given = save_pretrained_options(kwargs)
        target = Path(save_directory)
        if target.exists() and not target.is_dir():
            raise ValueError(f"save_pretrained({str(target)!r}): a file of that name exists; give a folder path")
        state = given if given is not None else dict(gathered_state_dict(self))
        write_into_folder(
            target, functools.partial(self._original.save_pretrained, state_dict=state, **kwargs), replaces=WEIGHT_FILES
        )
        logger.info("saved the unsplit %s to %s", type(self._original).__name__, target)

    def resize_token_embeddings(self, *args, **kwargs):
        raise NotImplementedError(
            "resize_token_embeddings on a split model: resize the unsplit model before tensor_parallel()"
        )

    def _set_gradient_checkpointing(self, enable: bool = True, *args, **kwargs):
        # transformers' gradient_checkpointing_enable() / activation_checkpointing_enable() end here; they flag
        # the layers of every shard (self.modules() reaches them), which then recompute in their own backward.
        if enable and not self._group.own_graphs:
            raise NotImplementedError(
                f"activation checkpointing on a model split over {self.labels} in debug mode: every shard is on "
                "one GPU, so their backward passes run as one graph, where a block recomputed in backward cannot "
                "meet the other shards. Turn debug mode off (TENSORSHARD_DEBUG), or train without checkpointing."
            )
        return super()._set_gradient_checkpointing(enable, *args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        # The model's own attributes (generation_config, loss_type, ...) are read by its forward on every
        # device: a new value goes to every device's copy, or is refused (shard_attributes.py); the config object
        # itself is shared, so it is changed field by field, not replaced.
        if name in self.__dict__.get("_adopted", ()):
            set_everywhere(self.module_shards, self._placement, self.splits, name, value, "")
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original")
            if original is not None and name in original._modules:
                return _submodule_view(self, name)
            if original is not None and (name in original._parameters or name in original._buffers):
                return _top_level_tensor(self, name)
            raise


# --- helpers ------------------------------------------------------------------------------------------


class _SubmoduleView(TensorParallel):
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
                return _submodule_view(self, name)
            if inspect.ismethod(local) and local.__self__ is first:
                return functools.partial(_on_every_shard(name, getattr(type(first), name)), self)
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
            return _submodule_view(self, key)
        names = self._child_names()
        if isinstance(key, slice):
            return [_submodule_view(self, n) for n in names[key]]
        return _submodule_view(self, names[key])  # IndexError / TypeError as a list of them raises

    def __len__(self) -> int:
        return len(self._child_names())

    def __iter__(self):
        if isinstance(self.module_shards[0], nn.ModuleDict):
            return iter(list(self.module_shards[0]._modules))  # the keys, as a ModuleDict iterates
        return iter([_submodule_view(self, n) for n in self._child_names()])

    def __bool__(self) -> bool:
        return not isinstance(self.module_shards[0], _CONTAINERS) or len(self) > 0

    def _child_names(self) -> list[str]:
        first = self.module_shards[0]
        if not isinstance(first, _CONTAINERS):
            raise TypeError(f"{type(first).__name__} (a view of it in the split model) is not a container of modules")
        return list(first._modules)


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _top_level_tensor(split: nn.Module, name: str) -> torch.Tensor:
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


def _method_view(model: TensorParallel, method: str) -> TensorParallel:
    """A view of `model` whose shards run `method` of its shards (cached on `model`)."""
    views = _own_cache(model, "_method_views")
    if method not in views:
        views[method] = make_view(model, "", TensorParallel, parts=[_CallMethod(shard, method) for shard in model.module_shards])
    return views[method]


def _submodule_view(model: TensorParallel, name: str) -> "_SubmoduleView":
    """A view running child `name` of every shard of `model` (cached on `model`)."""
    views = _own_cache(model, "_submodule_views")
    if name not in views:
        view = model.view(name)
        for key in model.__dict__.get("_adopted", ()):  # the model's own attributes: not this submodule's
            view.__dict__.pop(key, None)
        view.__dict__["_adopted"] = frozenset()
        parent = model.__dict__.get("_path", "") if isinstance(model, _SubmoduleView) else ""
        view.__dict__["_path"] = f"{parent}.{name}" if parent else name
        view.__class__ = _SubmoduleView
        views[name] = view
    return views[name]


def _own_cache(model: TensorParallel, key: str) -> dict:
    """A dict of `model`'s own: a view starts with a copy of its model's attributes, caches included."""
    owner = model.__dict__.get(f"{key}_owner")
    if owner is not model:
        model.__dict__[key] = {}
        model.__dict__[f"{key}_owner"] = model
    return model.__dict__[key]


def _align_experts(model: TensorParallel) -> None:
    """transformers' default "grouped_mm" experts kernel needs 16-byte aligned rows; an uneven split of the
    experts' hidden size (14336 over 3: 4779 features of 4 bytes) breaks that, so then the model uses the
    "batched_mm" kernel instead (same math, no alignment requirement): on every device, as the devices share
    one configuration."""
    first = model.module_shards[0]
    if getattr(getattr(first, "config", None), "_experts_implementation", None) != "grouped_mm":
        return
    unaligned = [
        label for label, shard in zip(model.labels, model.module_shards)
        if any(p.dim() == 3 and (p.shape[-1] * p.element_size()) % 16 for p in shard.parameters())
    ]
    if unaligned:
        first.set_experts_implementation("batched_mm")  # the shared config: every device
        logger.info("experts on %s: local sizes not 16-byte aligned; using the batched_mm kernel", ", ".join(unaligned))
