"""A KV cache filled by the unsplit model, handed to the split one: each device takes its own heads' slice.

    past = ref(ids, use_cache=True).past_key_values        # the unsplit model: every layer holds all KV heads
    out = model(next_ids, past_key_values=past)            # the split model converts it, in place, on first use

Cache layer i belongs to the attention modules whose ``layer_idx`` is i; the `Heads` entry of the plan for
such a module (or its nearest parent) says which KV heads each device holds (`HeadGroups`: with fewer KV
heads than devices, a head goes to every device whose query heads read it). Each device gets the keys
and values ``[:, first_head:last_head]`` of shape (batch, local KV heads, tokens, head_dim), copied to its
device. The unsplit tensors are not copied first: the per-device caches share the caller's structure,
each with its own tensors.

Several modules share a layer index in an encoder-decoder (T5's encoder and decoder self-attention and its
cross-attention, all ``layer_idx`` i): a layer goes by the modules whose KV head count is that of its keys,
and is refused if those split their heads differently.

Converted: any transformers `Cache` whose layers hold (key, value) pairs per head (`DynamicLayer` and its
kinds: sliding-window layers, the caches of subclasses such as offloaded ones), and an `EncoderDecoderCache`
of two such caches (the decoder's self-attention and its cross-attention over the encoder's output: both
halves divided by heads, its ``is_updated`` flags kept). Refused, with what to do instead: layers of other
kinds (recurrent state, quantized or indexer keys, static pre-allocation), and a layer whose head count no
attention module of the plan has.
"""

from __future__ import annotations

import copy

from torch import nn
from transformers import cache_utils
from transformers.cache_utils import Cache, DynamicLayer, EncoderDecoderCache

from ...partition import HeadGroups
from ...styles.heads import Heads

# DynamicLayer subclasses whose tensors are not plain keys and values per head. transformers 5.0 has only
# QuantizedLayer; later releases renamed it BaseQuantizedLayer and added the indexer and recurrent layers.
_NOT_KV_PAIRS = tuple(
    getattr(cache_utils, name)
    for name in ("QuantizedLayer", "BaseQuantizedLayer", "DynamicIndexedLayer", "LinearAttentionCacheLayerMixin")
    if hasattr(cache_utils, name)
)

_HOW = (
    "Start the split model from an empty cache (past_key_values=None or DynamicCache()) and feed it the "
    "prompt, or pass the past_key_values the split model itself returned."
)


def kv_heads_by_layer(model: nn.Module) -> dict[int, list[tuple[str, Heads, HeadGroups]]]:
    """layer_idx -> [(attention module name, its Heads entry, the head groups), ...] for a split model."""
    out: dict[int, list[tuple[str, Heads, HeadGroups]]] = {}
    for name, module in model.module_shards[0].named_modules():
        index = getattr(module, "layer_idx", None)
        if not isinstance(index, int) or isinstance(index, bool):
            continue
        parts = name.split(".") if name else []
        for depth in range(len(parts), -1, -1):  # the module itself, then its parents
            hit = model.plan.match(".".join(parts[:depth]))
            if hit is not None and isinstance(hit[1], Heads):
                style = hit[1]
                groups = HeadGroups.build(style.num_heads, style.kv, model.world_size, where=name)
                out.setdefault(index, []).append((name, style, groups))
                break
    return out


def split_filled_cache(cache: Cache, model: nn.Module) -> list[Cache]:
    """One cache per device, each holding its heads of every layer of `cache` (see the module doc)."""
    heads = kv_heads_by_layer(model)
    held = []  # (layer, keys, values, head groups) of every filled layer, of both halves of an encoder-decoder
    for label, half in _halves(cache):
        for i, layer in enumerate(half.layers):
            if not _holds_kv_pairs(layer):
                raise ValueError(
                    f"{label}cache layer {i} is a {type(layer).__name__}, which holds no per-head keys and values that "
                    f"could be divided among the devices. {_HOW}"
                )
            if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
                continue
            held.append((layer, layer.keys, layer.values, _groups(label, i, layer.keys, heads)))

    # The skeleton of each device's cache: a deep copy without the unsplit tensors, then its slices.
    for layer, *_ in held:
        layer.keys = layer.values = None
    try:
        ranks = [copy.deepcopy(cache) for _ in range(model.world_size)]
    finally:
        for layer, keys, values, _ in held:
            layer.keys, layer.values = keys, values
    devices = model.shard_devices
    for rank, per_rank in enumerate(ranks):
        layers = [layer for _, half in _halves(per_rank) for layer in half.layers]
        originals = [layer for _, half in _halves(cache) for layer in half.layers]
        copies = dict(zip(map(id, originals), layers))
        for layer, keys, values, groups in held:
            local = copies[id(layer)]
            start, stop = groups.kv[rank]
            local.keys = keys[:, start:stop].to(devices[rank], copy=True)  # (B, local kv heads, T, hd)
            local.values = values[:, start:stop].to(devices[rank], copy=True)
            local.device = devices[rank]
    return ranks


def _halves(cache: Cache) -> list[tuple[str, Cache]]:
    """The caches of (key, value) layers inside `cache`: itself, or an encoder-decoder cache's two."""
    if isinstance(cache, EncoderDecoderCache):
        halves = [("self-attention ", cache.self_attention_cache), ("cross-attention ", cache.cross_attention_cache)]
    else:
        halves = [("", cache)]
    for label, half in halves:
        if not isinstance(getattr(half, "layers", None), list):
            raise ValueError(
                f"the {label}cache is a {type(half).__name__} filled by another model, without per-layer keys and "
                f"values to divide among the devices. {_HOW}"
            )
    return halves


def _holds_kv_pairs(layer) -> bool:
    """A layer of keys and values per head, (batch, heads, tokens, head_dim), that slices by heads alone."""
    return (
        isinstance(layer, DynamicLayer)
        and not isinstance(layer, _NOT_KV_PAIRS)
    )


def _groups(label: str, i: int, keys, heads: dict) -> HeadGroups:
    """The head groups of cache layer `i`: those of the attention modules with that layer index whose KV head
    count is the keys' (one layout among them, or the layer is refused)."""
    where = f"{label}cache layer {i}"
    candidates = heads.get(i, [])
    if not candidates:
        raise ValueError(
            f"{where}: no attention module with layer_idx={i} under a Heads entry of the plan, so which device holds "
            f"which of its heads is unknown. {_HOW}"
        )
    fitting = [(name, style, groups) for name, style, groups in candidates if keys.dim() == 4 and keys.shape[1] == style.kv]
    if not fitting:
        counts = ", ".join(dict.fromkeys(f"{name} has {style.kv}" for name, style, _ in candidates))
        want = " or ".join(dict.fromkeys(f"(batch, {style.kv}, tokens, head_dim)" for _, style, _ in candidates))
        raise ValueError(
            f"{where} has keys of shape {tuple(keys.shape)}; {counts} KV heads (expected {want}): it was built by "
            f"another model. {_HOW}"
        )
    layouts = {groups.kv for _, _, groups in fitting}
    if len(layouts) > 1:
        raise ValueError(
            f"{where}: the attention modules with layer_idx={i} and {keys.shape[1]} KV heads "
            f"({', '.join(name for name, _, _ in fitting)}) split their heads differently, so the layer's owner is "
            f"ambiguous. {_HOW}"
        )
    return fitting[0][2]
