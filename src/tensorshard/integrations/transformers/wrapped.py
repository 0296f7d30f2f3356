"""A split module that contains a transformers model: a PeftModel, or your own wrapper around one.

    class Classifier(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm
        def forward(self, ids, **kwargs):
            return self.lm(ids, **kwargs).logits

    model = tp.tensor_parallel(Classifier(lm), ["cuda:0", "cuda:1"])   # the lm's preset, prefixed with "lm."
    model(ids, past_key_values=DynamicCache())                          # each device keeps its own heads' cache
    model.generate(ids, max_new_tokens=20)                              # the inner model's generate
    model.save_pretrained("out/")                                       # the inner model's unsplit checkpoint

The plan is the inner model's (preset or inferred), prefixed with its path (plan_inference/auto.py). The wrapper's
forward runs in every shard as usual; KV caches passed to or returned from it are per device
(cache.py). ``generate``, ``save_pretrained``, ``config`` and ``generation_config`` are the inner model's,
through `inner_model`: a split model of the inner model's class running that submodule of every shard.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ...engines.inprocess import TensorParallel
from ...model_kind import ModelKind
from .model import TransformersTensorParallel, transformers_view


class WrapperTensorParallel(TensorParallel):
    """A split module with a transformers model inside (see the module docstring)."""

    def __init__(self, module: nn.Module, device_ids=None, *, kind: ModelKind, **kwargs) -> None:
        """`kind`: `module`'s, as the front door decided it (model_kind.py)."""
        if not kind.holds_inner:
            raise TypeError(
                f"{type(module).__name__} is a {kind.name!r} model, not a module holding a transformers PreTrainedModel: "
                "split it with tensorshard.tensor_parallel(), which picks the right class"
            )
        super().__init__(module, device_ids, kind=kind, **kwargs)
        object.__setattr__(self, "_inner", (kind.inner_path, kind.inner))  # the consumed unsplit model: not a submodule
        object.__setattr__(self, "_inner_view", None)

    @property
    def inner_model(self) -> TransformersTensorParallel:
        """The transformers model inside, split: a view of this model's shards (see transformers_view)."""
        if self._inner_view is None:
            path, original = self._inner
            object.__setattr__(self, "_inner_view", transformers_view(self, path, original))
        return self._inner_view

    @property
    def device(self):
        """Where outputs land (the output device), as for a split transformers model."""
        return self.output_device

    @property
    def config(self):
        return self._inner[1].config

    @property
    def generation_config(self):
        return getattr(self._inner[1], "generation_config", None)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The inner model's ``generate`` (token-identical to the unsplit model's)."""
        return self.inner_model.generate(*args, **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """The inner model's unsplit checkpoint, as its own ``save_pretrained`` writes it."""
        self.inner_model.save_pretrained(save_directory, **kwargs)
