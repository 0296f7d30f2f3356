"""What both engines' fast decoding decides and says the same way: whether a cache is worth compiling for, which
settings of the model's layer wrappers a compiled step is specialised on, and the line logged when a decode step
compiled.

transformers' `generate` compiles the decode step when the cache is compileable (a static cache) and the device is
a GPU; a split model compiles on every device type, in one process (integrations/transformers/fast_decode.py,
each shard's step) and under torchrun (engines/torchrun/decoding.py, the one model of each rank). Both ask
`compileable_cache` of the call's cache and log a compile with `log_compiled`, so a user reads the same decision
and the same line from either engine:

    compiled the decode step of LlamaForCausalLM (batch 1, 1 new token(s), cache of 47 tokens (StaticCache),
    float32) on each of 2 device(s) in 14.2 s; torch.compile options {'fullgraph': False, 'dynamic': False}
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn

from ..layers import layer_wrapper
from ..registrations import registrations


def decode_cache(model_kwargs: Mapping[str, Any]) -> Any:
    """The KV cache among a call's keyword arguments (`cache` from transformers 5.24 on, `past_key_values`
    before), or None."""
    return next((model_kwargs[k] for k in ("cache", "past_key_values") if model_kwargs.get(k) is not None), None)


def compileable_cache(cache: Any) -> bool:
    """transformers' test for a cache worth compiling with: compileable, and not a plain DynamicCache (an
    encoder-decoder cache: its decoder's cache)."""
    decoder_cache = getattr(cache, "self_attention_cache", cache)
    return (
        bool(getattr(cache, "is_compileable", False))
        and bool(getattr(decoder_cache, "is_compileable", False))
        and type(decoder_cache).__name__ != "DynamicCache"
    )


def describe_step(kwargs: Mapping[str, Any], dtype: torch.dtype | None) -> str:
    """What a decode step is compiled for, in a few words: batch size, new tokens, cache length, dtype."""
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = kwargs.get("inputs_embeds")
    parts = []
    if isinstance(ids, torch.Tensor):
        parts.append(f"batch {ids.shape[0]}, {ids.shape[1] if ids.dim() > 1 else 1} new token(s)")
    cache = decode_cache(kwargs)
    layers = getattr(cache, "layers", None) or [None]
    length = getattr(layers[0], "max_cache_len", None)
    if length is not None:
        parts.append(f"cache of {length} tokens ({type(cache).__name__})")
    if dtype is not None:
        parts.append(str(dtype).removeprefix("torch."))
    return ", ".join(parts) or "no tensor inputs"


def log_compiled(logger: logging.Logger, name: str, step: str, seconds: float, options: Mapping[str, Any],
                 devices: int | None = None) -> None:
    """Log, at INFO, that the decode step of model class `name` compiled (`devices`: in one process, how many
    shards compiled their own)."""
    where = f" on each of {devices} device(s)" if devices else ""
    logger.info("compiled the decode step of %s (%s)%s in %.1f s; torch.compile options %s",
                name, step, where, seconds, dict(options))


class WrapperSettings:
    """The settings of every layer wrapper below `model` (layers.py `LayerWrapper.settings`: PEFT's active, merged
    and disabled adapters and their scales), as one hashable. A compiled step that skips dynamo's guards (the
    stitched and parallel steps in one process, the unguarded calls under torchrun) is specialised on them: a
    `set_adapter` or `disable_adapter()` makes another kind of call. The wrappers are looked up again whenever a
    module was registered (registrations.py)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._wrappers: list[tuple[nn.Module, Any]] = []  # (wrapper module, its settings reader)
        self._seen = -1  # registrations.py's count when they were looked up

    def __call__(self) -> tuple:
        seen = registrations()
        if seen != self._seen:
            self._wrappers = [(m, w.settings) for m in self.model.modules()
                              if (w := layer_wrapper(m)) is not None and w.settings is not None]
            self._seen = seen
        return tuple(read(m) for m, read in self._wrappers)
