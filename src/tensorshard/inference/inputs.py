"""The tiny input plan inference runs a model on, when the caller gives none.

A transformers-style model (it takes ``input_ids`` and has an input embedding or a vocabulary in its
config) gets ``input_ids`` of shape (2, 5); any other model gets an input shaped for the first supported
layer it holds: ids for an Embedding, (2, 5, in_features) for a Linear, small images for a Conv. A model
whose first Linear mixes tokens needs the middle size to be its token count, so the model's own widths
are tried next (`input_candidates`). Anything else: pass ``example_inputs=``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..layers import CONV, EMBEDDING, layer_kind, weight_shape

BATCH, SEQ = 2, 5  # the tiny synthetic input: 2 sequences of 5 tokens (or 2 x 5 x in_features)


def synthetic_inputs(model: nn.Module, *, generator: torch.Generator | None = None) -> tuple[tuple, dict]:
    """A tiny input the model accepts: ``input_ids`` for a transformers model, else one shaped for the
    first layer it holds (ids for an Embedding, (2, 5, in_features) for a Linear, images for a Conv2d)."""
    return next(iter(input_candidates(model, generator=generator)))


def input_candidates(model: nn.Module, *, generator: torch.Generator | None = None):
    """Tiny inputs to try, best guess first. For a Linear-first model the middle dimension is a guess
    (5); models that mix tokens with a Linear need it to be their token count, so every in_features of
    the model is tried next (an MLP-Mixer over 10 tokens takes (2, 10, patch))."""
    gen = generator or torch.Generator().manual_seed(0)
    params = _forward_params(model)
    vocab = _vocab_size(model)
    if vocab and "input_ids" in params:
        kwargs: dict[str, Any] = {"input_ids": _on(torch.randint(0, vocab, (BATCH, SEQ), generator=gen), model)}
        if "use_cache" in params:
            kwargs["use_cache"] = False
        yield (), kwargs
        return
    first = next(((m, layer_kind(m)) for _, m in model.named_modules() if layer_kind(m) is not None), None)
    if first is None:
        raise ValueError(
            f"{type(model).__name__} holds no Linear, Conv or Embedding layer, so there is nothing to split "
            "and no input to build; pass example_inputs=... or a plan"
        )
    mod, kind = first
    if kind is EMBEDDING:
        yield (_on(torch.randint(0, mod.num_embeddings, (BATCH, SEQ), generator=gen), mod),), {}
        return
    dtype = mod.weight.dtype if mod.weight.is_floating_point() else torch.float32
    if kind is CONV:
        dims = mod.weight.dim() - 2
        spatial = [max(8, 2 * k) for k in mod.kernel_size][:dims]
        yield (_on(torch.randn(BATCH, mod.in_channels, *spatial, generator=gen, dtype=dtype), mod),), {}
        return
    width = weight_shape(mod)[kind.weight_in_dim]
    sizes = [SEQ] + sorted({m.in_features for m in model.modules() if isinstance(m, nn.Linear)} - {SEQ})
    for seq in sizes[:8]:
        yield (_on(torch.randn(BATCH, seq, width, generator=gen, dtype=dtype), mod),), {}


def _vocab_size(model: nn.Module) -> int | None:
    """The vocabulary of a transformers-style model: its input embeddings', else its config's."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        emb = getter() if callable(getter) else None
    except Exception:  # some models raise NotImplementedError here
        emb = None
    if isinstance(emb, nn.Embedding):
        return emb.num_embeddings
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        vocab = getattr(cfg, "vocab_size", None)
        if isinstance(vocab, int) and vocab > 0:
            return vocab
    return None


def _forward_params(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _on(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    p = next(module.parameters(), None)
    if p is None or p.is_meta:
        return x
    return x.to(p.device)


def as_inputs(example: Any) -> tuple[tuple, dict]:
    """Normalise user-given example inputs: a tensor, a tuple of positional args, or a dict of kwargs."""
    if isinstance(example, dict):
        return (), dict(example)
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    return (example,), {}
