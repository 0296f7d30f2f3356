"""KV caches of split transformers models: one transformers `Cache` object, one real cache per device.

`generate()` creates a Cache and passes the same object to every forward call; the in-process engine hands
that one object to every shard. Each device, however, computes keys and values for its own heads only
(SmolLM2 on 2 devices: 2 KV heads on the first, 1 on the second), so each needs its own cache. A sharded
cache is the caller's Cache object turned, in place, into a dispatcher over one cache per device:

- inside a shard (`current_rank()` is set: the model's own code calling ``update``, ``get_seq_length``,
  ``self_attention_cache``...), every attribute is that device's cache's attribute;
- in the caller's thread (``generate`` asking for the sequence length, reordering beams, cropping), a
  method call runs on every device's cache and returns the first device's result; attributes are read
  from the first device's cache and written to all of them.

It stays an instance of its original class (a DynamicCache is still a DynamicCache, an EncoderDecoderCache
still an EncoderDecoderCache), so transformers' isinstance checks hold. Sliding-window layers (gemma2) and
encoder-decoder caches (t5) work because each device's cache is a deep copy of the empty original, built by
transformers' own code. A static cache (StaticCache, generate(cache_implementation="static")) allocates its layers
from the first keys and values it is given, so each device's copy holds that device's heads; a cache already
filled by the unsplit model is divided by heads (unsplit_cache.py). A model's own cache class that is not a
`Cache` (Reformer's ReformerDynamicCache) is sharded the same way when empty: shared, every device would
append its own states to it; filled elsewhere, it is refused (`is_cache`).
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves
from transformers.cache_utils import Cache, EncoderDecoderCache

from ...engines.inprocess.boundary import PerDevice, register_per_device
from ...engines.inprocess import current_rank

_RANKS = "_tensorshard_ranks"


class ShardedCache:
    """Mixin for a transformers `Cache` whose state lives in one cache per device (see the module doc)."""

    def __getattribute__(self, name: str) -> Any:
        if name == _RANKS or (name.startswith("__") and name.endswith("__")):
            return object.__getattribute__(self, name)
        ranks = object.__getattribute__(self, _RANKS)
        rank = current_rank()
        if rank is not None:
            return getattr(ranks[rank], name)
        value = getattr(ranks[0], name)
        if inspect.ismethod(value) and value.__self__ is ranks[0]:
            return _on_every_rank(ranks, name)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if name == _RANKS:
            object.__setattr__(self, name, value)
            return
        rank = current_rank()
        ranks = object.__getattribute__(self, _RANKS)
        for cache in ranks if rank is None else [ranks[rank]]:
            setattr(cache, name, value)


def _on_every_rank(ranks: list[Cache], name: str) -> Callable[..., Any]:
    def call(*args, **kwargs):
        results = [getattr(cache, name)(*args, **kwargs) for cache in ranks]
        return results[0]

    return call


@functools.lru_cache(maxsize=None)
def _sharded_class(cache_class: type) -> type:
    return type(f"Sharded{cache_class.__name__}", (ShardedCache, cache_class), {"__module__": __name__})


def rank_caches(cache: Cache) -> list[Cache]:
    """The per-device caches behind a sharded cache, in device order."""
    if not isinstance(cache, ShardedCache):
        raise TypeError(f"{type(cache).__name__} is not a sharded cache of a split model")
    return list(object.__getattribute__(cache, _RANKS))


def sharded(per_rank: list[Cache]) -> Cache:
    """A new sharded cache over caches the shards built themselves (the first call without a cache)."""
    cache = object.__new__(_sharded_class(type(per_rank[0])))
    object.__setattr__(cache, _RANKS, list(per_rank))
    return cache


def shard_cache(cache: Any, world_size: int, split_filled: Callable[[Cache], list[Cache]]) -> Cache:
    """Turn the caller's Cache into a sharded one, in place (a sharded cache is returned as is). A cache
    that already holds tokens (filled by the unsplit model) is divided by `split_filled` (unsplit_cache.py)."""
    if isinstance(cache, ShardedCache):
        held = len(rank_caches(cache))
        if held != world_size:
            raise ValueError(
                f"past_key_values holds the caches of {held} devices, but this model is split over {world_size}; "
                "pass the cache returned by this model, or None"
            )
        return cache
    if not isinstance(cache, Cache):
        raise TypeError(
            f"past_key_values must be a transformers Cache (e.g. DynamicCache()) or None; got {type(cache).__name__}. "
            "Tuples of tensors are no longer accepted by transformers."
        )
    ranks = split_filled(cache) if _seq_length(cache) > 0 else _empty_copies(cache, world_size)
    return _dispatch_over(cache, ranks)


def _empty_copies(cache: Cache, world_size: int) -> list[Cache]:
    """A copy of an empty cache for each device. Layers whose tensors are already allocated (sized for the
    unsplit model's heads) are returned to unallocated first, so that each device allocates its own heads' on
    first use: `reset()` zeroes a static cache but keeps its tensors, and transformers 5.0's generate() keeps
    its static cache on the model (``model._cache``) and resets it for the next call, so a model that generated
    with a static cache before it was split hands one over (later releases build a new cache per call)."""
    halves = [cache.self_attention_cache, cache.cross_attention_cache] if isinstance(cache, EncoderDecoderCache) else [cache]
    for layer in (layer for half in halves for layer in getattr(half, "layers", [])):
        if getattr(layer, "is_initialized", False) and isinstance(getattr(layer, "keys", None), torch.Tensor):
            layer.keys = layer.values = None  # (batch, unsplit KV heads, max tokens, head_dim), all zeros
            layer.is_initialized = False
    return [copy.deepcopy(cache) for _ in range(world_size)]


def _dispatch_over(cache: Any, ranks: list[Any]) -> Any:
    """Turn `cache`, in place, into the dispatcher over the per-device caches `ranks`."""
    object.__setattr__(cache, _RANKS, ranks)
    cache.__class__ = _sharded_class(type(cache))
    return cache


def join_caches(per_rank: list[Any]) -> Cache:
    """The caches the shards returned -> one for the caller: the sharded cache they were given, or a new
    sharded cache over the caches they built themselves (a first call without a cache)."""
    if all(c is per_rank[0] for c in per_rank):
        return per_rank[0]
    if not all(is_cache(c) and not isinstance(c, ShardedCache) for c in per_rank):
        raise RuntimeError(f"the shards returned different kinds of cache ({[type(c).__name__ for c in per_rank]}); they ran different code")
    return sharded(per_rank)


def _refuse_filled(cache: Cache) -> list[Cache]:
    raise ValueError(
        f"{type(cache).__name__} already holds tokens, passed to a split module that wraps a transformers model: "
        "only a split transformers model itself divides a filled cache by heads. Start from an empty cache and "
        "reuse the one the split model fills"
    )


# The methods by which a cache class of a model's own is recognised: `update` (Reformer's ReformerDynamicCache), or
# update_conv_state (transformers 5.0's recurrent caches, MambaCache and Mamba2Cache: later releases made them
# `Cache`s of recurrent layers, passed as `cache_params` all the same).
_OWN_CACHE_METHODS = ("update", "update_conv_state")


def is_cache(x: Any) -> bool:
    """A transformers `Cache`, or a cache class of a model's own that is not one (Reformer's
    ReformerDynamicCache of hashing buckets and states): a transformers class named ...Cache with an `update`."""
    if isinstance(x, Cache):
        return True
    cls = type(x)
    return (
        cls.__module__.startswith("transformers.")
        and cls.__name__.endswith("Cache")
        and any(callable(getattr(x, method, None)) for method in _OWN_CACHE_METHODS)
    )


def _per_device_cache(cache: Any, world: int) -> Any:
    """Every device's own cache behind the caller's object. A model's own (non-`Cache`) cache class: an empty one
    gets a copy per device; one holding state cannot be divided (its layout is the model's own), so it is refused
    rather than shared by the devices. Empty means no tensor with a nonzero value: a recurrent cache starts as
    zeros (transformers 5.0's Mamba2Cache, made by generate() before the first call)."""
    if isinstance(cache, (Cache, ShardedCache)):
        return shard_cache(cache, world, _refuse_filled)
    if any(isinstance(t, torch.Tensor) and t.numel() and bool(t.any()) for t in tree_leaves(vars(cache))):
        raise ValueError(
            f"{type(cache).__name__} already holds state, passed to a split model: only a cache this split model "
            "filled can be passed back to it (every device keeps its own). Start from None and reuse the cache it returns"
        )
    return _dispatch_over(cache, [copy.deepcopy(cache) for _ in range(world)])


# Any call of a split model (a transformers model, or a module containing one) gives each device its own cache.
register_per_device(PerDevice(accepts=is_cache, prepare=_per_device_cache, join=join_caches))


def _seq_length(cache: Cache) -> int:
    """Tokens the cache holds (for a cache of recurrent layers only, such as Mamba's: 1 once it has a state)."""
    inner = getattr(cache, "self_attention_cache", cache)  # EncoderDecoderCache: the decoder's own cache
    try:
        return inner.get_seq_length()
    except ValueError:  # transformers: "can only be called on Attention layers"
        layers = getattr(inner, "layers", [])
        return int(any(any(getattr(layer, "has_previous_state", {}).values()) for layer in layers))

