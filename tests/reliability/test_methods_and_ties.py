"""Refused or crashing where the unsplit model works, classes 3 and 4: submodules reached through a model's
methods run on whole weights under ZeRO-3; tied weights are followed wherever their names live."""

import copy

import pytest
import torch

import tensorshard as tp
from support.helpers import rel_err

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


def test_tied_weights_behind_a_prefix_split_alike(gen):
    peft = pytest.importorskip("peft")
    ref = tiny_t5().eval()
    wrapped = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(r=4, target_modules=["q", "v"]))
    # Before: "encoder.embed_tokens and shared are tied but split differently" (the preset's globs do not
    # reach behind base_model.model., the input embedding does).
    split = tp.tensor_parallel(wrapped, ["cpu"] * 2)
    for holder in ("shared", "encoder.embed_tokens", "decoder.embed_tokens", "lm_head"):
        assert split.plan.match(f"base_model.model.{holder}") is not None, holder
    ids = torch.randint(2, 96, (2, 7), generator=gen)
    labels = torch.randint(2, 96, (2, 5), generator=gen)
    with torch.no_grad():  # LoRA's B starts at zero: the wrapped model computes what the plain one does
        assert rel_err(split(input_ids=ids, labels=labels).logits, ref(input_ids=ids, labels=labels).logits) < 1e-5


def test_a_hand_plan_naming_one_holder_of_a_tied_weight_splits_them_all(gen):
    ref = tiny_t5().eval()
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan={"shared": tp.EmbeddingParallel()})
    assert split.plan.match("encoder.embed_tokens")[1] == tp.EmbeddingParallel()
    assert split.plan.match("lm_head")[1] == tp.ColwiseParallel(gather_output=True)
    ids = torch.randint(2, 96, (2, 7), generator=gen)
    with torch.no_grad():
        assert rel_err(split(input_ids=ids, decoder_input_ids=ids).logits, ref(input_ids=ids, decoder_input_ids=ids).logits) < 1e-5
