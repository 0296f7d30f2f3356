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
  images through it before the first token); views.py makes them;
- ``save_pretrained`` gathers the unsplit weights (on the CPU, one tensor at a time, then the whole state
  dict: peak host memory is one full copy of the model) and writes them with transformers' own
  ``save_pretrained`` of the original class, into a temporary folder moved into place;
- ``state_dict()`` is the shards' (use ``tp.save_tensor_parallel`` for the unsplit one); submodules such
  as ``model.model`` live in ``model.module_shards[r]``; ``split.model.encoder`` (``split.model.layers[0]``) is
  a view (views.py) that runs that submodule on every device, reads its other attributes from the first
  device's copy and sets them on every device's copy, or refuses (engines/inprocess/shard_attributes.py);
- gradient (activation) checkpointing, enabled before or after splitting, recomputes each block in its
  shard's own backward pass (engines/inprocess/shard_backward.py); not in debug mode on a GPU;
- ``num_parameters()`` is the unsplit model's count (engines/inprocess/param_count.py), not the sum over the
  devices' tensors (which counts a replicated norm once per device);
- ``generate(..., cache_implementation="static")`` decodes through every shard's compiled forward (fast_decode.py),
  on every device type; ``generation_config.disable_compile=True`` keeps it eager;
- unsupported, with an error saying so: output_attentions, resizing embeddings;
- training with dropout: replicated activations get one mask on every device (comm/dropout.py).
"""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from ...checkpoint.atomic import write_into_folder
from ...checkpoint.gather import WEIGHT_FILES, gathered_state_dict, save_pretrained_options
from ...engines.inprocess import TensorParallel
from ...engines.inprocess.param_count import count_parameters, unsplit_parameters
from ...engines.inprocess.shard_attributes import set_everywhere
from ...layers import is_transformers_model
from ...logs import get_logger
from ..peft.transformers_adapters import SplitAdapters
from .cache import shard_cache
from .fast_decode import compiled_call, wants_compiled_decode
from .unsplit_cache import split_filled_cache
from .part_views import on_every_shard, part_view, submodule_view, top_level_tensor

logger = get_logger(__name__)

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
            methods[method] = on_every_shard(method, getattr(model_class, method))
    for check in _SOURCE_CHECKS:
        if callable(getattr(model_class, check, None)):
            methods[check] = classmethod(functools.partial(_model_class_answers, getattr(model_class, check)))
    # SplitAdapters: transformers' add_adapter / load_adapter (integrations/peft/transformers_adapters.py)
    return type(name, (SplitAdapters, TransformersTensorParallel, model_class), methods)


_ENCODER_METHODS = ("get_image_features", "get_video_features", "get_audio_features")

# transformers decides whether a model may switch its attention / experts implementation by reading the source
# file of the class's module (looking for "@use_experts_implementation"): for the class made here that would
# be this file. transformers 5.0 reads it on every call, so generate() of a mixture-of-experts model fails
# ("does not support setting experts implementation"); later releases cache the answer on the model's class,
# which the split class happens to inherit. Either way, the answer is the model class's.
_SOURCE_CHECKS = ("_can_set_attn_implementation", "_can_set_experts_implementation")


def _model_class_answers(check, cls) -> bool:
    return check()


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
        return super().forward(**self.split_call(args, kwargs))  # caches the shards build are joined into one (cache.py)

    def split_call(self, args: tuple, kwargs: dict) -> dict:
        """A call's arguments as the shards take them: by name, with every cache turned into one per device."""
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
        return kwargs

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

    def _valid_auto_compile_criteria(self, model_kwargs: dict, generation_config) -> bool:
        """generate(): decode through compiled shards with a static cache, on every device type (fast_decode.py)."""
        return wants_compiled_decode(model_kwargs, generation_config)

    def get_compiled_call(self, compile_config) -> Any:
        """generate(): each shard's forward compiled, in place of the split model's call (fast_decode.py)."""
        return compiled_call(self, compile_config)

    @property
    def device(self) -> torch.device:
        """Where outputs land (generate creates its tensors there)."""
        return self.output_device

    def get_input_embeddings(self) -> nn.Module:
        return part_view(self, lambda m: m.get_input_embeddings())

    def get_output_embeddings(self) -> nn.Module | None:
        return part_view(self, lambda m: m.get_output_embeddings())

    def get_encoder(self, *args, **kwargs) -> nn.Module:
        return part_view(self, lambda m: m.get_encoder(*args, **kwargs))

    def get_decoder(self, *args, **kwargs) -> nn.Module:
        return part_view(self, lambda m: m.get_decoder(*args, **kwargs))

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

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """The unsplit model's count, as transformers' ``num_parameters`` gives it (the Trainer's FLOP count and
        the loggers read it): each parameter once, whatever the devices hold (engines/inprocess/param_count.py).
        Summing over the shards would count every replicated parameter once per device."""
        first = self.module_shards[0]
        embeddings = [f"{n}.weight" for n, m in first.named_modules() if isinstance(m, nn.Embedding)] if exclude_embeddings else []
        return count_parameters(unsplit_parameters(self), only_trainable=only_trainable, exclude=embeddings)

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
                return submodule_view(self, name)
            if original is not None and (name in original._parameters or name in original._buffers):
                return top_level_tensor(self, name)
            raise


# --- helpers ------------------------------------------------------------------------------------------


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
