"""Both engines decide alike whether `generate` compiles the decode step, and describe the step alike
(engines/decode_decision.py): the in-process engine's `wants_compiled_decode` and the torchrun engine's wrapper of
transformers' own criteria, asked the same questions on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from packaging import version
from transformers import DynamicCache, GenerationConfig, LlamaConfig, LlamaForCausalLM, StaticCache

from tensorshard.engines.decode_decision import compileable_cache, describe_step
from tensorshard.engines.torchrun.decoding import _on_every_device
from tensorshard.integrations.transformers.fast_decode import wants_compiled_decode


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def _caches(model):
    return {
        "static": StaticCache(config=model.config, max_cache_len=12),
        "dynamic": DynamicCache(config=model.config),
        "none": None,
    }


# the keyword generate() hands the cache over with, which transformers' own criteria read
KEYWORD = "cache" if version.parse(transformers.__version__) >= version.parse("5.24") else "past_key_values"


@pytest.mark.parametrize("disable_compile", [False, True])
def test_both_engines_compile_for_the_same_caches(model, disable_compile):
    torchrun_criteria = _on_every_device(model, type(model)._valid_auto_compile_criteria)
    config = GenerationConfig(disable_compile=disable_compile)
    before = copy.deepcopy(config.to_dict())
    for name, cache in _caches(model).items():
        kwargs = {KEYWORD: cache}
        expected = name == "static" and not disable_compile  # on CPU: only because a split model lifts the device rule
        assert wants_compiled_decode(kwargs, config) is expected, name
        assert bool(torchrun_criteria(kwargs, config)) is expected, name
        assert compileable_cache(cache) is (name == "static"), name
    assert config.to_dict() == before  # asked, not changed


def test_a_step_is_described_by_batch_new_tokens_cache_and_dtype(model):
    cache = StaticCache(config=model.config, max_cache_len=12)
    kwargs = {"input_ids": torch.zeros(3, 1, dtype=torch.long), "past_key_values": cache}
    assert describe_step(kwargs, torch.float32) == "batch 3, 1 new token(s), cache of 12 tokens (StaticCache), float32"
    assert describe_step({}, None) == "no tensor inputs"
