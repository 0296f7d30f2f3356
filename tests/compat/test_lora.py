"""The tensor_parallel package's LoRA recipe through tensorshard.compat: LoRA added first, then the PeftModel handed
to `TensorParallelPreTrainedModel` with the original's defaults (ZeRO-3 on). Compared with the unsplit PeftModel:
logits within 1e-5, greedy decoding token for token, and three AdamW steps within 1e-4 (fp32), at 2 and 3 devices."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

import tensorshard.compat as tp
from support.helpers import rel_err, train_both_causal_lm
from support.hf_configs import VOCAB, tiny_model

pytestmark = pytest.mark.timeout(120)

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]  # column and row layers both


def lora_llama():
    torch.manual_seed(1)  # init_lora_weights=False: B is random too, so the adapter counts from the first step
    return get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))


@pytest.mark.parametrize("world", [2, 3])
def test_a_peft_model_split_by_the_pretrained_class_computes_generates_and_trains_as_unsplit(world, gen):
    ref = lora_llama()  # 9 query heads in 3 KV groups
    model = tp.TensorParallelPreTrainedModel(ref, ["cpu"] * world)
    assert isinstance(model, tp.TensorParallelPreTrainedModel) and isinstance(model, tp.TensorParallel)
    assert isinstance(model, PeftModel) and model.wrapped_model is model
    assert model.sharding_manager is not None  # sharded=True, the original's default
    assert model.sharding_manager.world_size == world

    ids = torch.randint(1, VOCAB, (2, 7), generator=gen)
    assert rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-5
    prompt = ids[:, :4]
    assert torch.equal(model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False),
                       ref.generate(input_ids=prompt, max_new_tokens=6, do_sample=False))

    batches = [torch.randint(1, VOCAB, (2, 7), generator=gen) for _ in range(3)]
    for split, unsplit in train_both_causal_lm(model, ref, batches):
        assert abs(split - unsplit) < 1e-4 * abs(unsplit)
    assert rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-4


def test_the_pretrained_class_still_refuses_what_is_not_a_transformers_model():
    torch.manual_seed(0)
    plain = get_peft_model(torch.nn.Sequential(torch.nn.Linear(8, 8)), LoraConfig(r=2, target_modules=["0"]))
    with pytest.raises(TypeError, match=r"splits a transformers PreTrainedModel, or a PeftModel around one; got PeftModel"):
        tp.TensorParallelPreTrainedModel(plain, ["cpu", "cpu"])


@pytest.mark.parametrize("world", [2, 3])
def test_a_config_names_the_adapted_layers_as_the_model_without_adapters_does(world, gen):
    """Rules written for the bare model (``...q_proj.weight``, as PEFT named it when the original was written) split
    the adapted layers, and every adapter follows its layer's split."""
    ref = lora_llama()
    config = tp.pretrained_model.find_predefined_tensor_parallel_config(ref.config, ["cpu"] * world)
    model = tp.TensorParallelPreTrainedModel(ref, ["cpu"] * world, tensor_parallel_config=config)
    q = model.module_shards[world - 1].base_model.model.model.layers[0].self_attn.q_proj
    assert q.base_layer.weight.shape[0] < 72 and q.lora_B["default"].weight.shape[0] == q.base_layer.weight.shape[0]
    ids = torch.randint(1, VOCAB, (2, 7), generator=gen)
    assert rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-5
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, ref)]
    for _ in range(3):
        for m, opt in zip((model, ref), optimizers):
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    assert rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-4
