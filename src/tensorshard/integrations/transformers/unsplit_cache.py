"""A KV cache filled by the unsplit model, handed to the split one: each device takes its own heads' slice.

    past = ref(ids, use_cache=True).past_key_values        # the unsplit model: every layer holds all KV heads
    out = model(next_ids, past_key_values=past)            # the split model converts it, in place, on first use

Cache layer i belongs to the attention module whose ``layer_idx`` is i; the `Heads` entry of the plan for
that module (or its nearest parent) says which KV heads each device holds (`HeadGroups`: with fewer KV
heads than devices, a head goes to every device whose query heads read it). Each device gets the keys
and values ``[:, first_head:last_head]`` of shape (batch, local KV heads, tokens, head_dim), copied to its
device. The unsplit tensors are not copied first: the per-device caches share the caller's structure,
each with its own tensors.

Converted: `DynamicCache`s of attention layers (sliding-window layers included). Refused, with what to do
instead: layers of other kinds (recurrent state, static pre-allocation), encoder-decoder caches, and a
layer whose head count differs from the plan's.
"""

from __future__ import annotations

import copy

from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from ...partition import HeadGroups
from ...styles.heads import Heads

_HOW = (
    "Start the split model from an empty cache (past_key_values=None or DynamicCache()) and feed it the "
    "prompt, or pass the past_key_values the split model itself returned."
)


def kv_heads_by_layer(model: nn.Module) -> dict[int, tuple[str, Heads, HeadGroups]]:
    """layer_idx -> (attention module name, its Heads entry, the head groups) for a split model."""
    out: dict[int, tuple[str, Heads, HeadGroups]] = {}
    for name, module in model.module_shards[0].named_modules():
        index = getattr(module, "layer_idx", None)
        if not isinstance(index, int) or isinstance(index, bool) or index in out:
            continue
        parts = name.split(".") if name else []
        for depth in range(len(parts), -1, -1):  # the module itself, then its parents
            hit = model.plan.match(".".join(parts[:depth]))
            if hit is not None and isinstance(hit[1], Heads):
                style = hit[1]
                out[index] = (name, style, HeadGroups.build(style.num_heads, style.kv, model.world_size, where=name))
                break
    return out


def split_filled_cache(cache: Cache, model: nn.Module) -> list[Cache]:
    """One cache per device, each holding its heads of every layer of `cache` (see the module doc)."""
    layers = getattr(cache, "layers", None)
    if layers is None or hasattr(cache, "self_attention_cache"):
        raise ValueError(
            f"the cache is a {type(cache).__name__} filled by another model; only DynamicCaches of attention "
            f"layers are converted to the split model's per-device heads. {_HOW}"
        )
    heads = kv_heads_by_layer(model)
    tensors = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, DynamicLayer) or type(layer).__name__ == "DynamicIndexedLayer":
            raise ValueError(
                f"cache layer {i} is a {type(layer).__name__}, which holds no per-head keys and values that "
                f"could be divided among the devices. {_HOW}"
            )
        if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            tensors.append(None)
            continue
        if i not in heads:
            raise ValueError(
                f"cache layer {i}: no attention module with layer_idx={i} under a Heads entry of the plan, "
                f"so which device holds which of its heads is unknown. {_HOW}"
            )
        name, style, groups = heads[i]
        if layer.keys.dim() != 4 or layer.keys.shape[1] != style.kv:
            raise ValueError(
                f"cache layer {i} has keys of shape {tuple(layer.keys.shape)}; {name} has {style.kv} KV heads "
                f"(expected (batch, {style.kv}, tokens, head_dim)): it was built by another model. {_HOW}"
            )
        tensors.append((layer.keys, layer.values, groups))

    # The skeleton of each device's cache: a deep copy without the unsplit tensors, then its slices.
    for layer, held in zip(layers, tensors):
        if held is not None:
            layer.keys = layer.values = None
    try:
        ranks = [copy.deepcopy(cache) for _ in range(model.world_size)]
    finally:
        for layer, held in zip(layers, tensors):
            if held is not None:
                layer.keys, layer.values = held[0], held[1]
    devices = list(model._placement)
    for rank, per_rank in enumerate(ranks):
        for layer, held in zip(per_rank.layers, tensors):
            if held is None:
                continue
            keys, values, groups = held
            start, stop = groups.kv[rank]
            layer.keys = keys[:, start:stop].to(devices[rank], copy=True)  # (B, local kv heads, T, hd)
            layer.values = values[:, start:stop].to(devices[rank], copy=True)
            layer.device = devices[rank]
    return ranks
