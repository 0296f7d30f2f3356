"""A T5-style model fed the cache of another model, through tensorshard.compat, as the tensor_parallel package's tests
do (the split model continues from the unsplit one's ``past_key_values``): the `EncoderDecoderCache` is divided by
heads, both its self-attention and its cross-attention halves, at 2 and 3 devices (9 heads: 5 + 4, 3 + 3 + 3). So is
any cache class whose layers hold keys and values per head (here a DynamicCache subclass of one's own)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, EncoderDecoderCache

import tensorshard.compat as tp
from support.helpers import rel_err
from support.hf_configs import VOCAB, tiny_model

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("world", [2, 3])
def test_t5_continues_from_the_unsplit_models_encoder_decoder_cache(world, gen):
    ref = tiny_model("t5")
    model = tp.TensorParallelPreTrainedModel(ref, ["cpu"] * world)
    enc = torch.randint(1, VOCAB, (2, 6), generator=gen)
    dec = torch.randint(1, VOCAB, (2, 3), generator=gen)
    with torch.no_grad():
        first = ref(input_ids=enc, decoder_input_ids=dec, use_cache=True)
        past = first.past_key_values  # filled by the unsplit model: all 9 heads, 3 decoder tokens, 6 encoder tokens
        assert isinstance(past, EncoderDecoderCache) and past.cross_attention_cache.get_seq_length() == 6
        ref_past = copy.deepcopy(past)
        # The original's test: the split model, given the encoder input again and the reference's cache.
        step = torch.randint(1, VOCAB, (2, 1), generator=gen)
        want = ref(input_ids=enc, decoder_input_ids=step, past_key_values=copy.deepcopy(past)).logits
        assert rel_err(model(input_ids=enc, decoder_input_ids=step, past_key_values=copy.deepcopy(past)).logits, want) < 1e-5
        # Greedy decoding from the reference's cache, the encoder's output reused as generate does.
        encoded = (first.encoder_last_hidden_state,)
        token, tokens, ref_tokens = first.logits[:, -1:].argmax(-1), [], []
        ref_token = token
        for _ in range(4):
            got = model(encoder_outputs=encoded, decoder_input_ids=token, past_key_values=past).logits
            want = ref(encoder_outputs=encoded, decoder_input_ids=ref_token, past_key_values=ref_past).logits
            assert rel_err(got, want) < 1e-5
            token, ref_token = got[:, -1:].argmax(-1), want[:, -1:].argmax(-1)
            tokens.append(token)
            ref_tokens.append(ref_token)
    assert torch.equal(torch.cat(tokens, 1), torch.cat(ref_tokens, 1))
    assert past.get_seq_length() == 3 + 4 and isinstance(past, EncoderDecoderCache)  # converted in place


class MyCache(DynamicCache):
    """A cache class of one's own: its layers are transformers' DynamicLayers."""


@pytest.mark.parametrize("world", [2, 3])
def test_a_cache_subclass_filled_by_the_unsplit_model_is_divided_by_heads(world, gen):
    ref = tiny_model("llama")  # 3 KV heads
    model = tp.tensor_parallel(ref, ["cpu"] * world)
    prompt = torch.randint(1, VOCAB, (2, 5), generator=gen)
    with torch.no_grad():
        past = MyCache()
        ref(prompt, past_key_values=past)
        ref_past = copy.deepcopy(past)
        token = torch.randint(1, VOCAB, (2, 1), generator=gen)
        for _ in range(3):
            want = ref(token, past_key_values=ref_past).logits
            assert rel_err(model(token, past_key_values=past).logits, want) < 1e-5
            token = want[:, -1:].argmax(-1)
    assert isinstance(past, MyCache) and past.get_seq_length() == 5 + 3
