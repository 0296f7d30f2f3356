"""The tiny input plan inference runs a model on, when the caller gives none.

A transformers model gets what it describes itself (model_inputs.py: its main input sized by its config,
decoder ids for an encoder-decoder, its own ``dummy_inputs``); a model that takes ``input_ids`` and has a
vocabulary gets ``input_ids`` of shape (2, 5); any other model gets an input shaped for the first layer it
holds: ids for an Embedding, (2, 5, in_features) for a Linear, signals or images for a convolution (long
enough for the receptive field of its convolutions and pools, so a stack of dilated Conv1d layers runs).
A model whose first Linear mixes tokens needs the middle size to be its token count, so the model's own
widths are tried next (`input_candidates`). Anything else: pass ``example_inputs=``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..layers import CONV, EMBEDDING, layer_kind, weight_shape
from .model_inputs import forward_params, model_input_candidates, receptive_field, vocab_size

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
    described = list(model_input_candidates(model, gen))
    if described:
        yield from (((), kwargs) for kwargs in described)
        return
    params = forward_params(model)
    vocab = vocab_size(model)
    if vocab and "input_ids" in params:
        kwargs: dict[str, Any] = {"input_ids": _on(torch.randint(0, vocab, (BATCH, SEQ), generator=gen), model)}
        if "use_cache" in params:
            kwargs["use_cache"] = False
        yield (), kwargs
        return
    first = next(((m, _input_kind(m)) for _, m in model.named_modules() if _input_kind(m) is not None), None)
    if first is None:
        raise ValueError(
            f"{type(model).__name__} holds no Linear, Conv or Embedding layer to shape an input for; "
            "pass example_inputs=... (what its forward takes) or a plan"
        )
    mod, kind = first
    if kind is EMBEDDING:
        yield (_on(torch.randint(0, mod.num_embeddings, (BATCH, SEQ), generator=gen), mod),), {}
        return
    dtype = mod.weight.dtype if mod.weight.is_floating_point() else torch.float32
    if kind is CONV:
        dims = mod.weight.dim() - 2
        small = [max(8, 2 * k) for k in mod.kernel_size[:dims]]
        # Padded convolutions run on small inputs; unpadded or dilated stacks need their receptive field.
        for spatial in dict.fromkeys((tuple(small), tuple(max(s, _conv_length(model, d)) for d, s in enumerate(small)))):
            yield (_on(torch.randn(BATCH, mod.in_channels, *spatial, generator=gen, dtype=dtype), mod),), {}
        return
    width = weight_shape(mod)[kind.weight_in_dim]
    sizes = [SEQ] + sorted({m.in_features for m in model.modules() if isinstance(m, nn.Linear)} - {SEQ})
    for seq in sizes[:8]:
        yield (_on(torch.randn(BATCH, seq, width, generator=gen, dtype=dtype), mod),), {}
    # last: a plain (batch, features) input, for a BatchNorm1d after a Linear (channels on dim 1)
    yield (_on(torch.randn(BATCH, width, generator=gen, dtype=dtype), mod),), {}


_WINDOWED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
             nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)


def _input_kind(module: nn.Module):
    """The layer kind an input is shaped for: a supported layer's, or CONV for a transposed convolution
    (channels first like the others, although plans keep it whole)."""
    kind = layer_kind(module)
    if kind is None and isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return CONV
    return kind


def _conv_length(model: nn.Module, dim: int) -> int:
    """Input length along spatial `dim` that the model's convolutions and pools (in module order, as a
    chain) leave at least a few positions of: their receptive field plus two strides. Padding only
    lowers what is needed, so this is enough for any padding."""
    windows = []
    for m in model.modules():
        if isinstance(m, _WINDOWED):
            pick = lambda v: v[min(dim, len(v) - 1)] if isinstance(v, (tuple, list)) else v  # noqa: E731
            stride = pick(m.stride) if m.stride is not None else pick(m.kernel_size)
            if isinstance(m, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
                stride = 1  # upsamples: never shortens the signal
            windows.append((pick(m.kernel_size), stride, pick(getattr(m, "dilation", 1))))
    field, jump = receptive_field(windows)
    return field + 2 * jump if windows else 0


def first_that_runs(model: nn.Module, attempt: Callable[[tuple[tuple, dict]], Any]) -> tuple[tuple, dict]:
    """The first candidate input (see `input_candidates`) on which `attempt` raises nothing; when none
    runs, the first candidate's error is raised. A single candidate is returned untried."""
    candidates = list(input_candidates(model))
    if len(candidates) == 1:
        return candidates[0]
    first_error = None
    for inputs in candidates:
        try:
            attempt(inputs)
            return inputs
        except Exception as e:
            first_error = first_error or e
    raise first_error


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
