"""The transformers integration's answer to the fast decode path's questions (integrations/transformers/fast_decode.py
`TransformersCalls`, a `ShardCalls`: engines/inprocess/shard_calls.py): a call's arguments named as the model's
forward names them, with the cache turned into one per device; each shard handed its own device's cache; the
caller's cache back in a shard's output. No compiling here: test_static_cache.py decodes through it."""

from __future__ import annotations

import copy
import inspect

import torch
from transformers import StaticCache

import tensorshard as tp
from tensorshard.engines.inprocess.shard_calls import ShardCalls
from tensorshard.integrations.transformers.cache import ShardedCache, rank_caches
from tensorshard.integrations.transformers.fast_decode import TransformersCalls, compiled_call
from support.hf_configs import tiny_model


def test_each_shard_gets_its_own_cache_and_the_caller_gets_the_one_it_passed():
    model = tiny_model("llama")  # 9 heads in 3 KV groups: 2 KV heads on the first device, 1 on the second
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    calls = TransformersCalls(split)
    assert isinstance(calls, ShardCalls)
    name = "cache" if "cache" in inspect.signature(type(split).forward).parameters else "past_key_values"
    ids = torch.randint(3, 96, (1, 4), generator=torch.Generator().manual_seed(0))
    cache = StaticCache(config=model.config, max_cache_len=8)

    named = calls.keywords((ids,), {name: cache, "use_cache": True})
    assert named["input_ids"] is ids and named[name] is cache  # by name; the caller's cache object itself,
    assert isinstance(cache, ShardedCache)  # turned in place into the dispatcher over one cache per device
    own = [calls.own(cache, rank) for rank in range(2)]
    assert own == rank_caches(cache) and own[0] is not own[1] and not any(isinstance(c, ShardedCache) for c in own)
    assert calls.own(ids, 1) is ids and calls.own(True, 0) is True  # anything else: as given

    with torch.no_grad():  # a prefill through the split model: each device's cache holds that device's heads
        split(**named)
    assert [c.layers[0].keys.shape[1] for c in own] == [2, 1]

    out = {"logits": torch.zeros(1), name: own[1]}  # (a ModelOutput's fields) as shard 1 returns them
    back = calls.back(out, named)
    assert back[name] is cache and back["logits"] is out["logits"]
    assert calls.back({"logits": torch.zeros(1)}, {"input_ids": ids})  # no cache in the call: output as it is


def test_the_fast_path_is_given_the_integrations_calls():
    split = tp.tensor_parallel(tiny_model("llama"), ["cpu", "cpu"])
    steps = compiled_call(split, None)  # (made, not run: nothing compiles)
    assert isinstance(steps.calls, TransformersCalls) and steps.calls.model is split
