"""tensorshard.compat's classes and legacy entries: TensorParallelPreTrainedModel with the original's defaults,
TensorParallel's arguments, Sharded / apply_sharding / sharded_param_names as the original spelled them."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T
from torch import nn

import tensorshard as ts
import tensorshard.compat as tp
from support.helpers import rel_err
from support.hf_configs import VOCAB, tiny_model
from support.compat import MLP_RULES, Net, ids

pytestmark = pytest.mark.timeout(120)

CONFIG = tp.Config(MLP_RULES, {}, {r"mlp$": {0: "sum"}}, {})


def test_pretrained_model_class_is_sharded_by_default_and_generates_as_the_unsplit_model(gen):
    ref = tiny_model("llama")  # 9 query heads in 3 KV groups
    model = tp.TensorParallelPreTrainedModel(copy.deepcopy(ref), ["cpu", "cpu"])
    assert isinstance(model, tp.TensorParallelPreTrainedModel)
    assert isinstance(model, T.LlamaForCausalLM) and isinstance(model, tp.TensorParallel)
    assert "model.norm.weight" in model.zero_splits  # sharded=True, the original's default, also in eval()
    inputs = torch.randint(1, VOCAB, (2, 5), generator=gen)
    assert torch.equal(model.generate(inputs, max_new_tokens=6), ref.generate(inputs, max_new_tokens=6))
    with pytest.raises(TypeError, match="splits a transformers PreTrainedModel, or a PeftModel around one; got Linear"):
        tp.TensorParallelPreTrainedModel(nn.Linear(4, 4), ["cpu", "cpu"])
    plain = tp.tensor_parallel(Net(), ["cpu", "cpu"], tensor_parallel_config=CONFIG)
    assert not isinstance(plain, tp.TensorParallelPreTrainedModel) and isinstance(plain, tp.TensorParallel)


def test_the_class_defaults_to_sharded_and_takes_an_output_device_index(gen):
    torch.manual_seed(0)
    ref = Net()
    model = tp.TensorParallel(copy.deepcopy(ref), ["cpu", "cpu"], output_device_index=1, tensor_parallel_config=CONFIG)
    assert set(model.zero_splits) >= {"norm.weight", "embed.weight", "mlp.fc2.bias"}
    x = ids(gen)
    assert rel_err(model(x), ref(x)) < 1e-5
    with pytest.raises(ValueError, match="output_device_index=2, but there are 2 devices"):
        tp.TensorParallel(Net(), ["cpu", "cpu"], output_device_index=2)


def test_sharded_and_apply_sharding_take_the_originals_parameter_names(gen):
    torch.manual_seed(0)
    ref = Net()
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu", "cpu"], tensor_parallel_config=CONFIG, sharded=False)
    assert not getattr(model, "zero_splits", None)
    # The original named them from inside a shard, with its wrapper levels; both spellings are accepted.
    names = ["wrapped_model.module_shards.0.norm.weight", "module_shards.1.norm.weight", "mlp.fc2.tp_wrapped_module.bias"]
    assert tp.Sharded(model, names) is model
    assert set(model.zero_splits) == {"norm.weight", "mlp.fc2.bias"}
    assert model.module_shards[1].norm.weight.shape == (12,)  # 24 rows, half on each device
    x = ids(gen)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).pow(2).mean().backward()
        o.step()
    assert rel_err(model(x), ref(x)) < 1e-4
    with pytest.raises(RuntimeError, match="already applied"):
        model.apply_sharding()
    with pytest.raises(ValueError, match="'mlp.fc1.weight' is already split by the plan"):
        tp.tensor_parallel(Net(), ["cpu", "cpu"], tensor_parallel_config=CONFIG, sharded_param_names=["mlp.fc1.weight"])
    with pytest.raises(TypeError, match="model split by tensor_parallel"):
        tp.Sharded(Net())


def test_a_tensorshard_plan_is_accepted_where_a_config_was(gen):
    torch.manual_seed(0)
    ref = Net()
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu", "cpu"], tensor_parallel_config=CONFIG.to_plan(ref, 2))
    x = ids(gen)
    assert rel_err(model(x), ref(x)) < 1e-5 and isinstance(model.plan, ts.Plan)


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("0", False), ("", False), (None, False)])
def test_tensor_parallel_use_native_means_plain_pytorch_collectives(monkeypatch, value, on, gen):
    """The README's debugging switch: "1" turns NCCL off in favour of plain copies and sums ("0" does not,
    unlike the original, which read any non-empty value as on). On CPU both paths are the plain one."""
    from tensorshard.comm.threads import native_collectives

    if value is None:
        monkeypatch.delenv("TENSOR_PARALLEL_USE_NATIVE", raising=False)
    else:
        monkeypatch.setenv("TENSOR_PARALLEL_USE_NATIVE", value)
    assert native_collectives() is on
    torch.manual_seed(0)
    ref = Net()
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu", "cpu"], tensor_parallel_config=CONFIG)
    x = ids(gen)
    assert rel_err(model(x), ref(x)) < 1e-5


def test_plain_tensorshard_takes_a_config_too(gen):
    """`import tensorshard as tp` code that passes tensor_parallel_config=<a compat Config> (or plan=) gets it
    translated for the model and device count, as tensorshard.compat does."""
    torch.manual_seed(0)
    ref = Net()
    model = ts.tensor_parallel(copy.deepcopy(ref), ["cpu", "cpu"], tensor_parallel_config=CONFIG, sharded=False)
    assert model.plan == CONFIG.to_plan(ref, 2)
    x = ids(gen)
    assert rel_err(model(x), ref(x)) < 1e-5
