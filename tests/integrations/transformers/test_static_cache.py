"""Static KV caches and the compiled decoding path of split transformers models, in one process.

`generate(..., cache_implementation="static")` on a split model gives the unsplit model's greedy tokens, with every
device's cache holding its own heads; with compiling allowed (the default) every shard's decode step is compiled
once and replayed (integrations/transformers/fast_decode.py), with the same tokens and the same collectives per
token. Compiling is slow on 2 cores, so the compiled cases use the tiniest models and few tokens.
"""

from __future__ import annotations

import copy
import inspect
import logging

import pytest
import torch
from transformers import CompileConfig, StaticCache

import tensorshard as tp
from tensorshard.integrations.transformers.cache import rank_caches
from support.hf_configs import tiny_model

pytestmark = pytest.mark.timeout(600)

FAMILIES = ["llama", "gemma2", "gpt2", "mixtral", "falcon", "t5"]  # GQA, sliding window, fused qkv, MoE, MQA, enc-dec


def _ids(batch: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(0))


def _greedy(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, **kwargs)


def _cache_keyword(model) -> str:
    """The name of a cache passed in: `cache` where the model's forward takes it (transformers 5.24), else
    `past_key_values` (generate() passes it on under the forward's name)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_static_cache_gives_the_unsplit_tokens(family, devices):
    model = tiny_model(family)
    ids = _ids()
    expected = _greedy(model, ids)  # the dynamic cache, unsplit
    assert torch.equal(_greedy(model, ids, cache_implementation="static", disable_compile=True), expected)
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * devices)
    assert torch.equal(_greedy(split, ids, cache_implementation="static", disable_compile=True), expected)
    assert not split.__dict__.get("_tensorshard_compiled_steps"), "disable_compile=True compiled nonetheless"


def test_a_static_cache_passed_in_holds_each_devices_heads():
    model = tiny_model("llama")  # 9 heads in 3 KV groups: 2 KV heads on the first device, 1 on the second
    ids = _ids()
    expected = _greedy(model, ids)
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    cache = StaticCache(config=model.config, max_cache_len=16)
    out = _greedy(split, ids, disable_compile=True, **{_cache_keyword(split): cache})
    assert torch.equal(out, expected)
    heads = [own.layers[0].keys.shape[1] for own in rank_caches(cache)]
    assert heads == [2, 1]



def test_a_static_cache_the_unsplit_model_used_and_reset_is_reallocated_per_device():
    """reset() zeroes a static cache but keeps its tensors, sized for all 3 KV heads (transformers 5.0's generate()
    reuses one so, kept on the model): each device allocates its own heads' instead."""
    model = tiny_model("llama")
    ids = _ids()
    expected = _greedy(model, ids)
    cache = StaticCache(config=model.config, max_cache_len=16)
    _greedy(model, ids, disable_compile=True, **{_cache_keyword(model): cache})
    cache.reset()
    assert cache.layers[0].keys.shape[1] == 3 and cache.get_seq_length() == 0
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    out = _greedy(split, ids, disable_compile=True, **{_cache_keyword(split): cache})
    assert torch.equal(out, expected)
    assert [own.layers[0].keys.shape[1] for own in rank_caches(cache)] == [2, 1]

@pytest.fixture(scope="module")
def compiled_llama():
    """A tiny Llama split over 2 CPU slots that decoded once through compiled shards (inductor), and the log."""
    model = tiny_model("llama")
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("tensorshard.engines.inprocess.compiled_steps")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        out = _greedy(split, _ids(), cache_implementation="static")
    finally:
        logger.removeHandler(handler)
    return model, split, out, records


def test_compiled_decoding_gives_the_unsplit_tokens(compiled_llama):
    model, split, out, records = compiled_llama
    assert torch.equal(out, _greedy(model, _ids()))
    compiled = [r.getMessage() for r in records if "compiled the decode step" in r.getMessage()]
    assert len(compiled) == 1 and "on each of 2 device(s)" in compiled[0], compiled


def test_compiled_decoding_reuses_its_graphs(compiled_llama):
    """A second generate of the same shapes compiles nothing: no new dynamo frame, the same steps object."""
    model, split, _, _ = compiled_llama
    steps = dict(split.__dict__["_tensorshard_compiled_steps"])
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch.equal(_greedy(split, _ids(), cache_implementation="static"), _greedy(model, _ids()))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    assert split.__dict__["_tensorshard_compiled_steps"] == steps


def test_compiled_decoding_runs_the_collectives_of_the_eager_step(compiled_llama):
    """Each compiled token runs the eager token's collectives (2 per block + the embedding's + the head's), counted
    as ever: they are operators inside the graphs that call the same rendezvous."""
    _, split, _, _ = compiled_llama
    with tp.count_collectives() as eager:
        _greedy(split, _ids(), cache_implementation="static", disable_compile=True)
    with tp.count_collectives() as compiled:
        _greedy(split, _ids(), cache_implementation="static")
    assert compiled.counts == eager.counts and eager.counts["all_reduce"] > 0


def test_compiled_decoding_with_uneven_heads_over_3_devices():
    """9 heads over 3 devices, through AOT autograd's tracing of the collectives (inductor left out for time)."""
    model = tiny_model("qwen2")
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * 3)
    out = _greedy(split, _ids(), cache_implementation="static", compile_config=CompileConfig(backend="aot_eager"))
    assert torch.equal(out, _greedy(model, _ids()))
    assert split.__dict__["_tensorshard_compiled_steps"]


def test_the_dynamic_cache_is_not_compiled():
    model = tiny_model("gpt2")
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    assert torch.equal(_greedy(split, _ids()), _greedy(model, _ids()))
    assert not split.__dict__.get("_tensorshard_compiled_steps")


def test_compiled_decoding_of_a_split_peft_model():
    """A PeftModel split with its LoRA adapter: generate reaches the split transformers model inside, whose shards
    (each wrapped by PEFT's layers) compile as any other (AOT autograd's tracing: inductor left out for time)."""
    import peft

    model = peft.get_peft_model(
        tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    ids = _ids()
    compiled = _greedy(split, ids, cache_implementation="static", compile_config=CompileConfig(backend="aot_eager"))
    assert torch.equal(compiled, _greedy(model, ids))
