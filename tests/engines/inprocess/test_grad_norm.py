"""`split.clip_grad_norm_`: the unsplit model's gradient norm (each element counted once, at 1e-6 relative)
whether tensors are whole on every device (sharded=False), in ZeRO-3 pieces, or repeated (3 KV heads over 4
devices), and after clipping an SGD step lands where the unsplit model's does (logits within 1e-5)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tensorshard as tp
from support.helpers import rel_err

pytestmark = pytest.mark.timeout(120)


def llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=72, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3)
    return LlamaForCausalLM(config)


IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("n, sharded", [(2, False), (3, False), (4, False), (4, True)])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_norm_is_the_unsplit_models(n, sharded, norm_type):
    ref = llama()
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n, sharded=sharded)
    for m in (ref, model):
        m(input_ids=IDS, labels=IDS).loss.backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"), norm_type)
    got = model.clip_grad_norm_(float("inf"), norm_type)
    assert rel_err(got, want) < 1e-6
    if n == 4 and not sharded and norm_type == 2.0:  # what the plain function gives: repeated tensors counted again
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")) > want * 1.01


@pytest.mark.parametrize("n, sharded", [(3, False), (4, True)])
def test_clipped_step_matches_unsplit(n, sharded):
    ref = llama()
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n, sharded=sharded)
    for m, clip in ((ref, lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)), (model, lambda: model.clip_grad_norm_(0.5))):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
        m(input_ids=IDS, labels=IDS).loss.backward()
        assert clip() > 0.5  # it clips
        optimizer.step()
    with torch.no_grad():
        assert rel_err(model(input_ids=IDS).logits, ref(input_ids=IDS).logits) < 1e-5


def test_nonfinite_norm_is_refused_when_asked():
    model = tp.tensor_parallel(llama(), ["cpu"] * 2, sharded=False)
    model(input_ids=IDS, labels=IDS).loss.backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        model.clip_grad_norm_(1.0, error_if_nonfinite=True)
