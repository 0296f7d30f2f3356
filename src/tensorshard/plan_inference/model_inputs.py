"""The tiny input a transformers model describes itself: what plan inference runs it on.

A transformers model says what it reads first (``main_input_name``) and its config says how big it is.
This file turns the two into keyword arguments, batch 2, smallest that the model accepts:

- ``input_ids``: 5 ids below the vocabulary (the input embedding's, else the config's);
- ``pixel_values``: (2, num_channels, H, W) at the config's ``image_size`` (vision configs nested as
  ``vision_config`` too); a config without one gets 64 x 64, then 224 x 224;
- ``input_features``: Whisper-style (2, num_mel_bins, 2 * max_source_positions) when the config has both,
  else (2, frames, features) or (2, channels, frames) shaped for the first layer that reads them;
- ``input_values``: a waveform long enough for the convolutional feature extractor's receptive field;
- a vision tower that takes flattened patches and their ``grid_thw`` (Qwen2-VL's): two images of
  (1, 2m, 2m) patches, m its spatial merge size.

An encoder-decoder (``config.is_encoder_decoder``) also gets ``decoder_input_ids`` (4 ids starting with the
decoder start token) and nothing else on the decoder side, so models that cannot build decoder inputs
from ``input_ids`` (Pegasus, Marian, M2M100, ...) run. The model's own ``dummy_inputs`` come last, when
they name the main input. ``example_inputs=`` remains the way to give anything else.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator

import torch
from torch import nn

BATCH, SEQ, DECODER_SEQ = 2, 5, 4


def model_input_candidates(model: nn.Module, generator: torch.Generator) -> Iterator[dict[str, Any]]:
    """Keyword inputs to try for a transformers-style model (one with a config and a main input name),
    best guess first; nothing for other models."""
    config = getattr(model, "config", None)
    name = getattr(model, "main_input_name", None)
    params = forward_params(model)
    if config is not None and "grid_thw" in params:  # Qwen2-VL-style vision tower (main_input_name is wrong there)
        yield patch_grid_inputs(config, generator, dtype=_float_dtype(model), images=BATCH, device=model)
        return
    if config is None or not isinstance(name, str) or name not in params:
        return
    if name == "inputs":  # SpeechEncoderDecoder and friends: the encoder says what its inputs are
        inner = getattr(getattr(model, "encoder", None), "main_input_name", None)
        name = inner if isinstance(inner, str) and inner in params else name
    extra: dict[str, Any] = {}
    if "use_cache" in params or _passes_kwargs(model) and _config_has(config, "use_cache"):
        extra["use_cache"] = False  # a cache built by the pass would be captured as the self-check's input
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        extra["decoder_input_ids"] = _on(decoder_ids(model, generator), model)
    for other in _required(model) - {name} - set(extra):  # BLIP-2 reads pixel_values first, input_ids too
        extra.update(next(_main_inputs(model, other, generator), {}))
    mains = list(_main_inputs(model, name, generator))
    for main in mains:
        yield {**main, **extra}
    if "decoder_input_ids" in extra:  # BART's classifiers shift input_ids themselves and need equal lengths
        own = {k: v for k, v in extra.items() if k != "decoder_input_ids"}
        for main in mains:
            yield {**main, **own}
    dummy = _dummy_inputs(model, name, params)
    if dummy is not None:
        yield {**dummy, **{k: v for k, v in extra.items() if k not in dummy}}


def _main_inputs(model: nn.Module, name: str, gen: torch.Generator) -> Iterator[dict[str, torch.Tensor]]:
    config = model.config
    if name in ("input_ids", "inputs"):
        vocab = vocab_size(model)
        if vocab:
            ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
            yield {name: _on(ids, model)}
            sentence = _sentence(ids, config, vocab)
            if sentence is not None:
                yield {name: _on(sentence, model)}
    elif name == "pixel_values":
        channels = _config_int(config, ("num_channels", "in_channels", "in_chans", "num_input_channels"), 3)
        dtype = _float_dtype(model)
        for h, w in _image_sizes(config):
            yield {name: _on(torch.randn(BATCH, channels, h, w, generator=gen, dtype=dtype), model)}
    elif name == "input_features":
        dtype = _float_dtype(model)
        for shape in _feature_shapes(model):
            yield {name: _on(torch.randn(*shape, generator=gen, dtype=dtype), model)}
    elif name == "input_values":
        length = _waveform_length(config)
        yield {name: _on(torch.randn(BATCH, length, generator=gen, dtype=_float_dtype(model)), model)}


def _sentence(ids: torch.Tensor, config, vocab: int) -> torch.Tensor | None:
    """`ids` as sentences: special tokens (pad, bos, eos) inside replaced, each ending in the eos token.
    Classifiers of encoder-decoders (BART's) pool at the eos token and need one per sequence; None when the
    config names no eos token."""
    eos = getattr(config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    if not isinstance(eos, int) or not 0 <= eos < vocab:
        return None
    special = {v for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
               for v in _ints(getattr(config, key, None))}
    plain = next((i for i in range(vocab) if i not in special), None)
    if plain is None:
        return None
    out = ids.clone()
    for token in special:
        out[out == token] = plain
    out[:, -1] = eos
    return out


def _ints(value) -> list[int]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def patch_grid_inputs(config, gen: torch.Generator, *, dtype=torch.float32, images: int = BATCH,
                      device: nn.Module | None = None, key: str = "hidden_states", grid_key: str = "grid_thw"):
    """A Qwen2-VL-style vision input: each image a grid of (1, 2m, 2m) patches (m = the spatial merge
    size), flattened to rows of channels x temporal patch x patch x patch values, with the grid beside."""
    merge = _config_int(config, ("spatial_merge_size",), 1)
    patch = _config_int(config, ("patch_size",), 14)
    temporal = _config_int(config, ("temporal_patch_size",), 1)
    channels = _config_int(config, ("in_channels", "num_channels", "in_chans"), 3)
    side = 2 * merge
    rows = torch.randn(images * side * side, channels * temporal * patch * patch, generator=gen, dtype=dtype)
    grid = torch.tensor([[1, side, side]] * images)
    if device is not None:
        rows, grid = _on(rows, device), _on(grid, device)
    return {key: rows, grid_key: grid}


def decoder_ids(model: nn.Module, gen: torch.Generator, length: int = DECODER_SEQ) -> torch.Tensor:
    """(2, length) decoder ids: the decoder start token, then random ids of the decoder's vocabulary."""
    config = model.config
    decoder_cfg = getattr(config, "decoder", None)
    vocab = _config_int(decoder_cfg, ("vocab_size",), 0) if decoder_cfg is not None else 0
    vocab = vocab or vocab_size(model) or 2
    start = next((v for c in (config, decoder_cfg) if c is not None
                  for v in (getattr(c, "decoder_start_token_id", None), getattr(c, "pad_token_id", None))
                  if isinstance(v, int) and 0 <= v < vocab), 0)
    ids = torch.randint(0, vocab, (BATCH, length), generator=gen)
    ids[:, 0] = start
    return ids


def vocab_size(model: nn.Module) -> int | None:
    """The vocabulary of a transformers-style model: its input embeddings', else its config's."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        emb = getter() if callable(getter) else None
    except Exception:  # some models raise NotImplementedError here
        emb = None
    if isinstance(emb, nn.Embedding):
        return emb.num_embeddings
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None), getattr(config, "decoder", None)):
        vocab = getattr(cfg, "vocab_size", None)
        if isinstance(vocab, int) and vocab > 0:
            return vocab
    return None


def _required(model: nn.Module) -> set[str]:
    """Arguments the forward cannot do without (no default) that this file knows how to build."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return set()
    known = {"input_ids", "pixel_values", "input_features", "input_values"}
    return {p.name for p in params if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD and p.name in known}


def _passes_kwargs(model: nn.Module) -> bool:
    try:
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return False


def _config_has(config, key: str) -> bool:
    return any(hasattr(c, key) for c in (config, getattr(config, "text_config", None)) if c is not None)


def forward_params(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


# --- sizes from the config --------------------------------------------------------------------------------


def _configs(config) -> list:
    """The config and the vision/audio/encoder configs nested in it, outermost first."""
    out = [config]
    for key in ("vision_config", "audio_config", "encoder_config", "encoder", "backbone_config"):
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out.append(sub)
    return out


def _config_int(config, keys: tuple[str, ...], default: int) -> int:
    if config is None:
        return default
    for cfg in _configs(config):
        for key in keys:
            value = getattr(cfg, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return default


def _image_sizes(config) -> list[tuple[int, int]]:
    """The config's image size (ViTs need exactly it: their position embeddings are per patch), else
    64 x 64 (enough for a ConvNet's downsampling), then 224 x 224."""
    sizes = []
    for cfg in _configs(config):
        value = getattr(cfg, "image_size", None) or getattr(cfg, "img_size", None)
        if isinstance(value, int) and value > 0:
            sizes.append((value, value))
        elif isinstance(value, (list, tuple)) and len(value) >= 2 and all(isinstance(v, int) for v in value[-2:]):
            sizes.append((int(value[-2]), int(value[-1])))
    for fallback in ((64, 64), (224, 224)):
        if fallback not in sizes:
            sizes.append(fallback)
    return sizes[:3]


def _feature_shapes(model: nn.Module) -> list[tuple[int, ...]]:
    """Speech features: Whisper-style (batch, mel bins, frames) at the exact length its encoder's position
    table expects, else shaped for the first layer that reads them (channels first for a Conv1d)."""
    config = model.config
    shapes = []
    mels = _config_int(config, ("num_mel_bins",), 0)
    positions = _config_int(config, ("max_source_positions",), 0)
    if mels and positions:
        shapes.append((BATCH, mels, 2 * positions))
    per_channel = _config_int(config, ("input_feat_per_channel",), 0)
    if per_channel:
        shapes.append((BATCH, 32, per_channel * _config_int(config, ("input_channels",), 1)))
    first = next((m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d))), None)
    if isinstance(first, nn.Conv1d):
        shapes.append((BATCH, first.in_channels, max(32, 2 * positions)))
    elif isinstance(first, nn.Linear):
        shapes.append((BATCH, 32, first.in_features))
    size = _config_int(config, ("feature_size", "num_mel_bins", "feature_projection_input_dim"), 0)
    if size:
        shapes += [(BATCH, 32, size), (BATCH, size, 32)]
    return list(dict.fromkeys(shapes))


def _waveform_length(config) -> int:
    """Samples enough for a few frames out of a convolutional feature extractor (kernel and stride lists in
    the config, as wav2vec2-style models have), else 1600."""
    kernels = getattr(config, "conv_kernel", None)
    strides = getattr(config, "conv_stride", None)
    if isinstance(kernels, (list, tuple)) and isinstance(strides, (list, tuple)) and len(kernels) == len(strides):
        field, jump = receptive_field(list(zip(kernels, strides)))
        return max(1600, field + 4 * jump)
    return 1600


def receptive_field(layers: list[tuple[int, int]] | list[tuple[int, int, int]]) -> tuple[int, int]:
    """(receptive field, total stride) of a chain of (kernel, stride[, dilation]) windows: the shortest
    input one output position needs, and how far apart output positions are in the input."""
    field, jump = 1, 1
    for layer in layers:
        kernel, stride = layer[0], layer[1]
        dilation = layer[2] if len(layer) > 2 else 1
        field += dilation * (kernel - 1) * jump
        jump *= stride
    return field, jump


def _dummy_inputs(model: nn.Module, name: str, params: set[str]) -> dict[str, Any] | None:
    """The model's own ``dummy_inputs``, when they hold its main input and only arguments it takes."""
    try:
        dummy = model.dummy_inputs
    except Exception:
        return None
    if not isinstance(dummy, dict) or name not in dummy or not set(dummy) <= params:
        return None
    if not all(isinstance(v, torch.Tensor) for v in dummy.values()):
        return None
    vocab = vocab_size(model)
    ids = dummy.get("input_ids")
    if vocab and isinstance(ids, torch.Tensor) and int(ids.max()) >= vocab:
        return None
    return {k: _on(v, model) for k, v in dummy.items()}


def _float_dtype(model: nn.Module) -> torch.dtype:
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    return p.dtype if p is not None else torch.float32


def _on(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    p = next(module.parameters(), None)
    if p is None or p.is_meta:
        return x
    return x.to(p.device)
