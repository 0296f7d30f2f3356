"""model_kind: which of the four kinds a model is, and which transformers model inside it the later steps use.

The front door asks once and hands the answer on: a wrapper split by `tensor_parallel` takes its inner model from
the kind, and a split class built by hand refuses a model of the wrong kind before anything is split.
"""

from __future__ import annotations

import copy
import sys
from contextlib import contextmanager

import pytest
import torch
from torch import nn

import tensorshard as tp
from tensorshard.integrations.peft.recognised import PEFT
from tensorshard.model_kind import MODULE, TRANSFORMERS, WRAPPER, model_kind

pytestmark = pytest.mark.timeout(120)

transformers = pytest.importorskip("transformers")


def tiny_llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


class Holder(nn.Module):
    def __init__(self, *lms: nn.Module) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.lms = nn.ModuleList(lms)


def test_plain_modules_and_non_modules_are_module_kind():
    for thing in (nn.Linear(4, 4), Holder(), "not a module"):
        kind = model_kind(thing)
        assert (kind.name, kind.inner_path, kind.inner) == (MODULE, None, None)
        assert not kind.holds_transformers_model


def test_a_transformers_model_is_its_own_inner_model():
    lm = tiny_llama()
    kind = model_kind(lm)
    assert (kind.name, kind.inner_path) == (TRANSFORMERS, "") and kind.inner is lm


def test_a_module_holding_transformers_models_names_the_first_one():
    first, second = tiny_llama(), tiny_llama()
    kind = model_kind(Holder(first, second))
    assert (kind.name, kind.inner_path) == (WRAPPER, "lms.0") and kind.inner is first


def test_peft_models_around_transformers_and_around_plain_modules():
    peft = pytest.importorskip("peft")
    lm = tiny_llama()
    kind = model_kind(peft.get_peft_model(lm, peft.LoraConfig(r=2, target_modules=["q_proj"])))
    assert (kind.name, kind.inner_path) == (PEFT, "base_model.model") and kind.inner is lm
    plain = peft.get_peft_model(nn.Sequential(nn.Linear(4, 4)), peft.LoraConfig(r=2, target_modules=["0"]))
    assert model_kind(plain).name == MODULE  # no transformers model inside: the engine splits it as it is


def test_the_split_wrapper_uses_the_inner_model_the_front_door_found():
    first, second = tiny_llama(), tiny_llama()
    split = tp.tensor_parallel(Holder(first, second), ["cpu", "cpu"], check=False)
    assert type(split).__name__ == "WrapperTensorParallel"
    assert split._inner == ("lms.0", first) and split.config is first.config
    assert "lms.0.model.layers.*.self_attn.q_proj" in split.plan  # the inner model's preset under its path


def test_a_wrapper_class_refuses_a_model_of_another_kind_before_splitting():
    from tensorshard.integrations.transformers import WrapperTensorParallel

    lm = tiny_llama()
    with pytest.raises(TypeError, match="'transformers' model, not a module holding"):
        WrapperTensorParallel(lm, ["cpu", "cpu"], kind=model_kind(lm))
    assert not any(p.is_meta for p in lm.parameters())  # refused before the engine consumed it


@contextmanager
def kind_calls():
    """The modules `model_kind` is called on in this thread meanwhile (its code object seen by a profiler: counted
    however a caller imported the function)."""
    calls, code = [], model_kind.__code__

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            calls.append(type(frame.f_locals["module"]).__name__)

    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(before)


@pytest.mark.parametrize("build", ["module", "transformers", "peft", "wrapper"])
def test_the_kind_is_decided_once_per_split(build):
    """The front door asks; the engine, the plan resolution and the automatic plan (recursing into a PEFT model's
    or a wrapper's inner model) take the answer as it is handed on."""
    if build == "module":
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    elif build == "transformers":
        model = tiny_llama()
    elif build == "peft":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    else:
        model = Holder(tiny_llama())
    with kind_calls() as calls:
        tp.tensor_parallel(model, ["cpu", "cpu"], check=False)
    assert calls == [type(model).__name__]


def test_a_deep_copy_of_a_split_wrapper_asks_the_kind_of_its_copy_once():
    split = tp.tensor_parallel(Holder(tiny_llama()), ["cpu", "cpu"], check=False)
    with kind_calls() as calls:
        twin = copy.deepcopy(split)
    assert calls == ["Holder"] and type(twin).__name__ == "WrapperTensorParallel"
    assert twin._inner[0] == "lms.0" and twin._inner[1] is not split._inner[1]  # the copy's inner model
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(twin.inner_model(ids).logits, split.inner_model(ids).logits)
