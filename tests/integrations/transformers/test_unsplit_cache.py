"""A KV cache built by the unsplit model, passed to the split one (``past_key_values=`` from a reference
run): divided by heads on first use, so the split model continues exactly where the unsplit one stopped."""

from __future__ import annotations

import copy

import pytest
import torch

import tensorshard as tp
from support.helpers import rel_err
from support.hf_configs import VOCAB, tiny_config, tiny_model
from tensorshard.integrations.transformers import rank_caches

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("family, devices, local_kv", [
    ("llama", 2, [2, 1]),  # 3 KV heads over 2 devices
    ("gemma", 2, [1, 1]),  # 1 KV head, held by both devices
    ("gemma2", 3, [1, 1, 1]),  # sliding-window layers
])
def test_a_cache_filled_by_the_unsplit_model_continues_on_the_split_one(family, devices, local_kv, gen):
    ref = tiny_model(family)
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * devices)
    prompt = torch.randint(1, VOCAB, (2, 6), generator=gen)
    with torch.no_grad():
        first = ref(prompt, use_cache=True)
        past = first.past_key_values  # filled by the unsplit model: all KV heads of every layer
        ref_past = copy.deepcopy(past)
        token = first.logits[:, -1:].argmax(-1)
        for _ in range(3):  # greedy steps from the unsplit model's cache
            want = ref(token, past_key_values=ref_past).logits
            assert rel_err(model(token, past_key_values=past).logits, want) < 1e-5
            token = want[:, -1:].argmax(-1)
    caches = rank_caches(past)  # converted in place: one cache per device, each with its heads
    assert [c.layers[0].keys.shape[1] for c in caches] == local_kv
    assert past.get_seq_length() == 6 + 3


def test_a_cache_of_another_geometry_is_refused_with_what_to_do(gen):
    ref = tiny_model("llama")  # 3 KV heads
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu", "cpu"])
    other = tiny_config("llama")
    other.num_key_value_heads = 9
    past = tiny_model("llama", other)(torch.randint(1, VOCAB, (1, 4), generator=gen), use_cache=True).past_key_values
    with pytest.raises(ValueError, match=r"cache layer 0 has keys of shape \(1, 9, 4, 8\); model.layers.0.self_attn has 3 KV "
                       r"heads.*Start the split model from an empty cache"):
        model(torch.ones(1, 1, dtype=torch.long), past_key_values=past)


def test_a_filled_recurrent_cache_is_refused_with_what_to_do(gen):
    import transformers as T

    config = T.Mamba2Config(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
                            expand=2, n_groups=1, state_size=16, chunk_size=16, pad_token_id=0)
    torch.manual_seed(0)
    ref = T.AutoModelForCausalLM.from_config(config).eval()
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu", "cpu"])
    ids = torch.randint(1, 96, (1, 5), generator=gen)
    with torch.no_grad():
        state = ref(ids, use_cache=True).cache_params  # the unsplit model's recurrent state
    if isinstance(state, T.Cache):  # a Cache of recurrent layers
        refusal = r"cache layer 0 is a \w+, which holds no per-head keys and values.*Start the split model from an empty cache"
    else:  # transformers 5.0: Mamba2Cache, a cache class of the model's own
        refusal = r"Mamba2Cache already holds state, passed to a split model.*Start from None"
    with pytest.raises(ValueError, match=refusal):
        model(ids[:, -1:], cache_params=state)


def test_an_encoder_decoder_cache_is_divided_in_both_halves(gen):
    ref = tiny_model("t5")  # 9 heads, in self-attention and cross-attention alike
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu", "cpu"])
    enc = torch.randint(1, VOCAB, (2, 6), generator=gen)
    with torch.no_grad():
        first = ref(input_ids=enc, decoder_input_ids=enc[:, :2], use_cache=True)
        past, ref_past = first.past_key_values, copy.deepcopy(first.past_key_values)
        step, encoded = enc[:, 2:3], (first.encoder_last_hidden_state,)
        want = ref(encoder_outputs=encoded, decoder_input_ids=step, past_key_values=ref_past).logits
        assert rel_err(model(encoder_outputs=encoded, decoder_input_ids=step, past_key_values=past).logits, want) < 1e-5
    caches = rank_caches(past)
    for half, tokens in (("self_attention_cache", 3), ("cross_attention_cache", 6)):
        shapes = [tuple(getattr(c, half).layers[1].keys.shape) for c in caches]
        assert shapes == [(2, 5, tokens, 8), (2, 4, tokens, 8)]  # 9 heads: 5 + 4, the encoder's 6 tokens kept
    assert all(c.is_updated == {0: True, 1: True} for c in caches)  # the cross-attention is not recomputed


def test_a_cross_attention_half_of_another_geometry_is_refused(gen):
    ref = tiny_model("t5")
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu", "cpu"])
    enc = torch.randint(1, VOCAB, (1, 4), generator=gen)
    with torch.no_grad():
        past = ref(input_ids=enc, decoder_input_ids=enc[:, :2], use_cache=True).past_key_values
    layer = past.cross_attention_cache.layers[0]
    layer.keys, layer.values = layer.keys[:, :6], layer.values[:, :6]  # 6 heads: another model's
    with pytest.raises(ValueError, match=r"cross-attention cache layer 0 has keys of shape \(1, 6, 4, 8\); "
                       r"encoder.block.0.layer.0.SelfAttention has 9.* KV heads .*Start the split model from an empty"):
        model(input_ids=enc, decoder_input_ids=enc[:, 2:3], past_key_values=past)
