"""Refused or crashing where the unsplit model works, classes 6, 7 and 8: a split model is split once,
copies (copy.deepcopy, torch.save) work or name the right tool, and an unsplit state dict loads."""

import copy
import io

import pytest
import torch
from torch import nn

import tensorshard as tp
from helpers import rel_err

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
