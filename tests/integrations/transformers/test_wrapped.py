"""A transformers model inside your own module, split: the inner model's plan (prefixed), a KV cache per device
through the wrapper's forward, the inner model's generate and save_pretrained; objects passed into a call are
never shared by the shards."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache

import tensorshard as tp
from support.hf_configs import FAMILIES
from support.helpers import rel_err

pytestmark = pytest.mark.timeout(120)


class Wrapper(nn.Module):
    """Five lines, as users write them."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, past_key_values=None):
        return self.lm(input_ids=ids, past_key_values=past_key_values, use_cache=True)


def tiny():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES["llama"][0]()).eval()


@pytest.mark.parametrize("n", [2, 3])
def test_wrapped_model_decodes_generates_and_saves(tmp_path, n):
    ref = Wrapper(tiny())
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n)
    assert "lm.model.layers.*.self_attn.q_proj" in model.plan  # the llama preset, prefixed with the wrapper's path
    tokens, caches = [torch.tensor([[5, 17, 42, 9]])] * 2, (DynamicCache(), DynamicCache())
    with torch.no_grad():
        for _ in range(3):  # incremental decoding: each device keeps its own heads' cache
            outs = [m(t, past_key_values=c).logits for m, t, c in zip((model, ref), tokens, caches)]
            assert rel_err(outs[0], outs[1]) < 1e-5
            tokens = [o[:, -1:].argmax(-1) for o in outs]
        fresh = model(tokens[0]).past_key_values  # a cache the shards built: one per device, joined
        assert fresh.get_seq_length() == 1
    prompt = torch.tensor([[5, 17, 42, 9]])
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), ref.lm.generate(prompt, max_new_tokens=6, do_sample=False))
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        assert rel_err(AutoModelForCausalLM.from_pretrained(tmp_path)(prompt).logits, ref.lm(prompt).logits) < 1e-5


class Collector(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, seen=None, stream=None):
        if seen is not None:
            seen.append(x.shape)
        if stream is not None:
            next(stream)
        return self.lin(x)


def test_objects_passed_into_a_call_are_not_shared():
    model = tp.tensor_parallel(Collector(), ["cpu"] * 2, plan={})
    seen = []
    model(torch.randn(2, 8), seen=seen)  # every shard appends to its own copy of the list
    assert seen == []
    with pytest.raises(TypeError, match="iterator"):
        model(torch.randn(2, 8), stream=iter(range(3)))
