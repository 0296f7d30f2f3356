"""A split model reports the parameter count of the model it stands for (engines/inprocess/param_count.py).

transformers' ``num_parameters`` and PEFT's ``get_nb_trainable_parameters`` / ``print_trainable_parameters``
sum ``numel()`` over the parameters they see: on a split model, every device's tensors, so a parameter the
plan leaves whole (a norm) counted once per device, and the rows of a KV head repeated on several devices
(3 KV heads over 4) too. Users and the Trainer log that number; the split model answers the unsplit one's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

import tensorshard as tp
from support.hf_configs import tiny_model

pytestmark = pytest.mark.timeout(120)

COUNTS = [{}, {"only_trainable": True}, {"exclude_embeddings": True}, {"only_trainable": True, "exclude_embeddings": True}]


def frozen_norms(model):
    """A train-mode model whose norms are frozen: ZeRO-3 (on by default in training) leaves them whole."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.requires_grad_(False)
    return model.train()


def lora(model):
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def split(model, n: int, **options):
    return tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * n, **options)


@pytest.mark.parametrize("n", [2, 3, 4])  # 9 query heads in 3 KV groups: 3 devices split unevenly, 4 repeat KV heads
@pytest.mark.parametrize("train,sharded", [(False, False), (True, None), (True, False)])
def test_num_parameters_is_the_unsplit_models(n, train, sharded):
    ref = frozen_norms(tiny_model("llama")) if train else tiny_model("llama")
    model = split(ref, n, sharded=sharded)
    zero = getattr(model, "zero_splits", None) or {}
    assert any(split is None and name not in zero for name, split in model.splits.items() if "norm" in name)  # whole on every device
    for options in COUNTS:
        assert model.num_parameters(**options) == ref.num_parameters(**options), options


def test_zero3_partitioned_model_counts_each_parameter_once():
    ref = tiny_model("llama").train()
    model = split(ref, 3, sharded=True)
    assert model.zero_splits  # the norms are partitioned
    for options in COUNTS:
        assert model.num_parameters(**options) == ref.num_parameters(**options), options


@pytest.mark.parametrize("order", ["peft-then-split", "split-then-peft"])
@pytest.mark.parametrize("n", [2, 3])
def test_split_peft_model_counts_as_peft_counts_the_unsplit_one(order, n, capsys):
    ref = lora(tiny_model("llama"))
    if order == "peft-then-split":
        model = split(ref, n)
    else:
        torch.manual_seed(0)
        model = lora(split(tiny_model("llama"), n))
    assert model.get_nb_trainable_parameters() == ref.get_nb_trainable_parameters()
    for options in COUNTS:
        assert model.num_parameters(**options) == ref.num_parameters(**options), options
    capsys.readouterr()
    ref.print_trainable_parameters()
    want = capsys.readouterr().out
    model.print_trainable_parameters()
    assert capsys.readouterr().out == want and "all params" in want
