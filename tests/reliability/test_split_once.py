"""Refused or crashing where the unsplit model works, classes 6, 7 and 8: a split model is split once,
copies (copy.deepcopy, torch.save) work or name the right tool, and an unsplit state dict loads."""

import copy
import io

import pytest
import torch
from torch import nn

import tensorshard as tp
from support.helpers import rel_err

pytestmark = pytest.mark.timeout(90)

PLAN = {"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


# --- 7: splitting twice -----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [mlp, tiny_llama], ids=["plain", "transformers"])
def test_splitting_a_split_model_is_refused(make):
    split = tp.tensor_parallel(make(), ["cpu"] * 2)
    with pytest.raises(TypeError, match=r"is already split over 2 device\(s\).*it is a model tensor_parallel\(\) returned"):
        tp.tensor_parallel(split, ["cpu"] * 2)  # transformers: before the fix, an MRO TypeError


@pytest.mark.parametrize("make", [mlp, tiny_llama], ids=["plain", "transformers"])
def test_splitting_the_consumed_original_again_is_refused(make):
    original = make()
    tp.tensor_parallel(original, ["cpu"] * 2)
    with pytest.raises(TypeError, match=r"was already split over 2 device\(s\) .* by an earlier tensor_parallel\(\) call"):
        tp.tensor_parallel(original, ["cpu"] * 2)  # before: accepted; its first call asked for tp.load_sharded


# --- 8: an unsplit state dict ------------------------------------------------------------------------------


@pytest.mark.parametrize("sharded", [False, True])
def test_an_unsplit_state_dict_loads_into_the_split_model(gen, sharded):
    trained = mlp()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)
    split = tp.tensor_parallel(mlp().train(), ["cpu"] * 3, plan=PLAN, sharded=sharded)
    result = split.load_state_dict(trained.state_dict())  # before: torch's missing-keys error
    assert result.missing_keys == [] and result.unexpected_keys == []
    x = torch.randn(4, 8, generator=gen)
    assert rel_err(split(x), trained(x)) < 1e-6
    with tp.save_tensor_parallel(split):
        assert all(torch.equal(v, trained.state_dict()[k]) for k, v in split.state_dict().items())


def test_an_unsplit_state_dict_with_wrong_keys_is_refused_by_name(gen):
    split = tp.tensor_parallel(mlp(), ["cpu"] * 2, plan=PLAN)
    state = {k: v + 1.0 for k, v in mlp().state_dict().items()}
    state["3.weight"] = state.pop("2.weight")
    with pytest.raises(RuntimeError, match=r"missing keys: 2\.weight.*unexpected keys: 3\.weight"):
        split.load_state_dict(state)
    before = split(torch.ones(1, 8))
    result = split.load_state_dict(state, strict=False)  # before: silently loaded nothing
    assert result.missing_keys == ["2.weight"] and result.unexpected_keys == ["3.weight"]
    assert not torch.equal(split(torch.ones(1, 8)), before)  # the keys that match did load


def test_a_transformers_state_dict_with_a_tied_head_loads(gen):
    ref = tiny_llama()
    ref.config.tie_word_embeddings = True
    ref.tie_weights()
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2)
    torch.manual_seed(1)
    other = type(ref)(ref.config).eval()
    state = {k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}  # as safetensors stores it
    assert split.load_state_dict(state).missing_keys == []
    ids = torch.randint(0, 64, (2, 6), generator=gen)
    with torch.no_grad():
        assert rel_err(split(input_ids=ids).logits, other(input_ids=ids).logits) < 1e-5


# --- 6: copies ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sharded", [False, True])
def test_deepcopy_makes_an_independent_split_model(gen, sharded):
    ref = mlp().train()
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=PLAN, sharded=sharded)
    twin = copy.deepcopy(split)  # before: "cannot pickle '_thread.RLock'"
    x = torch.randn(4, 8, generator=gen)
    assert torch.equal(twin(x), split(x))
    assert twin.memory_per_device() == split.memory_per_device()
    opt = torch.optim.SGD(split.parameters(), lr=0.1)  # train the original only: the copy must not move
    split(x).square().mean().backward()
    opt.step()
    assert rel_err(twin(x), ref(x)) < 1e-6 and rel_err(split(x), ref(x)) > 1e-3
    assert all(t.grad is None for t in twin.parameters())


def test_deepcopy_of_a_transformers_model_generates_alike(gen):
    split = tp.tensor_parallel(tiny_llama(), ["cpu"] * 2)
    twin = copy.deepcopy(split)
    assert type(twin) is type(split) and not twin.training
    ids = torch.randint(0, 64, (1, 5), generator=gen)
    assert torch.equal(twin.generate(ids, max_new_tokens=4, do_sample=False), split.generate(ids, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("make", [mlp, tiny_llama], ids=["plain", "transformers"])
def test_torch_save_of_a_split_model_names_the_savers(make):
    split = tp.tensor_parallel(make(), ["cpu"] * 2)
    with pytest.raises(TypeError, match=r"cannot be pickled .*tp\.save_sharded\(model, folder\).*tp\.save_tensor_parallel"):
        torch.save(split, io.BytesIO())  # before: a PicklingError about a generated class
