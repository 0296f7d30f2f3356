"""PEFT's state-dict functions on a split model, in either order: ``set_peft_model_state_dict`` loads an
adapter saved from an unsplit model (each device takes its slices, logits within 1e-5 of the unsplit
PeftModel's), refuses a state dict that could be either of two adapters, and ``tp.save_tensor_parallel`` gives
the unsplit state dict of a PeftModel around a split model."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

import tensorshard as tp
from support.helpers import rel_err
from support.hf_configs import tiny_model

pytestmark = pytest.mark.timeout(120)


def config(**options) -> LoraConfig:
    return LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False, **options)


def ids() -> torch.Tensor:
    return torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(5))


def split_with_adapter(base, order: str, n: int):
    """A split model with a fresh (random) adapter "default", in the given order."""
    torch.manual_seed(7)  # another adapter than the saved one: loading must replace it
    if order == "adapter, then split":
        return tp.tensor_parallel(get_peft_model(copy.deepcopy(base), config()), ["cpu"] * n)
    return get_peft_model(tp.tensor_parallel(copy.deepcopy(base), ["cpu"] * n), config())


@pytest.mark.parametrize("order", ["adapter, then split", "split, then adapter"])
@pytest.mark.parametrize("n", [2, 3])
def test_set_peft_model_state_dict_loads_an_unsplit_adapter(order, n):
    base = tiny_model("llama").eval()
    torch.manual_seed(3)
    ref = get_peft_model(copy.deepcopy(base), config()).eval()
    model = split_with_adapter(base, order, n).eval()
    with torch.no_grad():
        assert rel_err(model(input_ids=ids()).logits, ref(input_ids=ids()).logits) > 1e-3  # another adapter so far
    result = set_peft_model_state_dict(model, get_peft_model_state_dict(ref))
    assert result.unexpected_keys == []
    with torch.no_grad():
        assert rel_err(model(input_ids=ids()).logits, ref(input_ids=ids()).logits) < 1e-5


@pytest.mark.parametrize("order", ["adapter, then split", "split, then adapter"])
def test_a_state_dict_that_fits_two_adapters_is_refused(order, tmp_path):
    base = tiny_model("llama").eval()
    torch.manual_seed(3)
    ref = get_peft_model(copy.deepcopy(base), config()).eval()
    if order == "adapter, then split":
        two = copy.deepcopy(ref)
        two.add_adapter("other", config())
        model = tp.tensor_parallel(two, ["cpu"] * 2)
    else:
        model = split_with_adapter(base, order, 2)
        model.add_adapter("other", config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"holds \['default', 'other'\].*load_adapter\(folder, adapter_name="):
        set_peft_model_state_dict(model, get_peft_model_state_dict(ref), adapter_name="other")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_save_tensor_parallel_of_a_peft_model_around_a_split_model_gives_the_unsplit_state_dict():
    base = tiny_model("llama").eval()
    torch.manual_seed(3)
    ref = get_peft_model(copy.deepcopy(base), config()).eval()
    model = split_with_adapter(base, "split, then adapter", 2)
    set_peft_model_state_dict(model, get_peft_model_state_dict(ref))
    with tp.save_tensor_parallel(model):
        state = model.state_dict()
    want = ref.state_dict()
    assert state.keys() == want.keys()
    assert all(torch.equal(state[k], want[k]) for k in want)
    fresh = PeftModel(copy.deepcopy(base), config())  # plain PyTorch loading into an unsplit PeftModel
    fresh.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids()).logits, ref(input_ids=ids()).logits)


def test_save_tensor_parallel_refuses_a_module_with_tensors_of_its_own_beside_a_split_model():
    holder = torch.nn.Module()
    holder.split = tp.tensor_parallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)), ["cpu"] * 2)
    holder.extra = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="needs a model split by tensorshard"):
        with tp.save_tensor_parallel(holder):
            pass
    del holder.extra
    with tp.save_tensor_parallel(holder):
        assert set(holder.state_dict()) == {"split.0.weight", "split.0.bias", "split.1.weight", "split.1.bias"}
