"""Refused or crashing where the unsplit model works, classes 3 and 4: submodules reached through a model's
methods run on whole weights under ZeRO-3; tied weights are followed wherever their names live."""

import copy

import pytest
import torch

import tensorshard as tp
from helpers import rel_err

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(90)


def tiny_t5() -> "transformers.T5ForConditionalGeneration":
    config = transformers.T5Config(
        d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=96, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():  # T5's init is tiny: make the tokens depend on every weight
            p.normal_(0.0, 0.3)
    return model


def test_methods_of_a_zero3_model_run_on_whole_weights(gen):
    ref = tiny_t5().train()
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2)
    assert split.zero_splits  # sharded=True is the default in train mode: the norms are partitioned
    ids = torch.randint(2, 96, (2, 7), generator=gen)
    for method in ("get_encoder", "get_decoder", "get_input_embeddings"):
        assert getattr(split, method)() is not None
    enc, enc_ref = split.get_encoder()(input_ids=ids), ref.get_encoder()(input_ids=ids)
    assert rel_err(enc.last_hidden_state, enc_ref.last_hidden_state) < 1e-5  # before the fix: a size mismatch
    enc.last_hidden_state.square().mean().backward()  # gradients reach the partitioned norm weights
    assert all(p.grad is not None for n, p in split.named_parameters() if "encoder" in n and "layer_norm" in n)
    ref.eval()
    split.eval()
    assert torch.equal(
        split.generate(ids, max_new_tokens=6, do_sample=False), ref.generate(ids, max_new_tokens=6, do_sample=False)
    )
