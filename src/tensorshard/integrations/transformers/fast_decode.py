"""`generate(..., cache_implementation="static")` on a split model: every shard's decode step compiled.

transformers' own fast decoding is a static KV cache plus `torch.compile` of the model's forward, which
`generate` turns on by itself on CUDA (`_valid_auto_compile_criteria`, `get_compiled_call`): the prefill runs
eagerly, every later token through the compiled call. A split model answers the same two questions its own way:

- whether to compile: whenever the cache is compileable (a static cache) and `generation_config.disable_compile`
  is not set, on every device type: a split model's token is dominated by its shards' Python, which compiling
  removes, on CPU slots as on GPUs;
- what to compile: not the split model's call (threads and a rendezvous: nothing a compiler can trace), but each
  shard's forward, once, with the collectives kept inside the graphs (engines/inprocess/compiled_steps.py,
  comm/thread_ops.py). The compile options are `generation_config.compile_config`'s; `mode="reduce-overhead"`
  (CUDA graphs, transformers' default) captures each GPU shard's step in CUDA graphs cut at its collectives, and
  on CPU slots only is replaced by inductor's default mode, logged (engines/inprocess/cuda_graph_mode.py). On CPU
  slots the shards' graphs are then stitched into one graph run from the calling thread
  (engines/inprocess/stitched_decode.py; `compiled_call(model, None).keep_one_graph_per_shard()` opts out).

The compiled steps are kept on the model (one set per compile options) and reused by every later `generate`.
What recompiles them: a new batch size, a new cache length (`max_cache_len`, which `generate` sets from
`max_new_tokens` unless the cache is passed in), a new dtype, or different options. Each compile is logged with
its duration.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers.cache_utils import Cache

from ...logs import get_logger
from ...engines.decode_decision import compileable_cache, decode_cache
from ...engines.inprocess.compiled_steps import CompiledSteps
from ...engines.inprocess.cuda_graph_mode import decode_options
from ...engines.inprocess.shard_calls import ShardCalls
from .cache import ShardedCache, rank_caches

logger = get_logger(__name__)

_STEPS = "_tensorshard_compiled_steps"


def wants_compiled_decode(model_kwargs: dict, generation_config) -> bool:
    """`generate`'s question: decode through compiled shards? Yes for a compileable (static) cache, on any device,
    unless `generation_config.disable_compile` (the torchrun engine's decision too: engines/decode_decision.py)."""
    if getattr(generation_config, "disable_compile", False):
        return False
    cache = decode_cache(model_kwargs)
    return isinstance(cache, Cache) and compileable_cache(cache)


def compiled_call(model, compile_config) -> CompiledSteps:
    """The compiled steps of `model` for these options (made once, kept on the model)."""
    asked = _options(model, compile_config)
    key = tuple(sorted((k, repr(v)) for k, v in asked.items()))
    kept = model.__dict__.setdefault(_STEPS, {})
    if key not in kept:
        options = decode_options(asked, model.devices, model_name=type(model).__name__)  # (logs a replaced mode once)
        kept[key] = CompiledSteps(model, options, calls=TransformersCalls(model))
    return kept[key]


def _options(model, compile_config) -> dict[str, Any]:
    config = compile_config if compile_config is not None else getattr(model.generation_config, "compile_config", None)
    options = dataclasses.asdict(config) if config is not None and dataclasses.is_dataclass(config) else {}
    options = {k: v for k, v in options.items() if not k.startswith("_")}
    options.setdefault("fullgraph", False)
    options.setdefault("dynamic", False)
    return {k: v for k, v in options.items() if not (k in ("mode", "options") and v is None)}


class TransformersCalls(ShardCalls):
    """A split transformers model's calls on the fast path (engines/inprocess/shard_calls.py): arguments named as its
    forward names them, each shard handed its own cache (cache.py's `ShardedCache` is the dispatcher over them), the
    dispatcher the call was given back in the output in place of the shard's own."""

    def __init__(self, model) -> None:
        self.model = model

    def keywords(self, args: tuple, kwargs: dict) -> dict:
        return self.model.split_call(args, kwargs)  # (model.py: every cache turned into one per device)

    @staticmethod  # (no state of its own: a plain function, called per argument per shard on every token)
    def own(value: Any, rank: int) -> Any:
        return rank_caches(value)[rank] if isinstance(value, ShardedCache) else value

    def back(self, out: Any, kwargs: dict) -> Any:
        given = next((v for v in kwargs.values() if isinstance(v, ShardedCache)), None)
        if given is None:
            return out
        own = set(map(id, rank_caches(given)))
        if hasattr(out, "keys"):  # a ModelOutput
            for key in list(out.keys()):
                if id(out[key]) in own:
                    out[key] = given
        return out
