"""`balance=True` under torchrun: the GQA Llama whose 3 KV heads split 2 + 1 over 2 ranks gets MLP slices of
112 / 144 features (their stacked, zero-padded DTensors, comm/dtensor.py), and computes the unsplit model's
logits (1e-5 relative), training losses (1e-4 after three AdamW steps) and fast-path tokens with the even split's
collectives; a deep copy splits alike; a LoRA adapter added after the split follows it; its checkpoints (tp.save_sharded, and the unsplit
files of save_pretrained) reload in one process at 3 devices and unsplit. The sizes: tests/plans/test_balance.py."""

import copy

import pytest
import torch

import tensorshard as tp
from support.harness import world_mesh
from support.helpers import train_causal_lms

pytestmark = pytest.mark.timeout(240)


def balanced_task(folder: str) -> dict:
    import torch.distributed as dist
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import CompileConfig

    from support import tiny_llama

    ref = tiny_llama.build_uneven_heads()
    ids = torch.randint(0, tiny_llama.VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    model = tp.parallelize(copy.deepcopy(ref), world_mesh(), balance=True)
    even = tp.parallelize(copy.deepcopy(ref), world_mesh())
    copied = copy.deepcopy(model)  # split again from the skeleton, balanced too
    out = {"widths": [m.mlp.gate_proj.out_features for m in model.model.layers],
           "down": model.model.layers[0].mlp.down_proj.in_features,
           "copy": [m.mlp.up_proj.out_features for m in copied.model.layers]}

    def err(a, b) -> float:
        return ((a - b).norm() / b.norm()).item()

    with torch.no_grad():
        out["logits"] = err(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        prompt = ids[:1]
        settings = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                        pad_token_id=0)
        expected = ref.generate(prompt, **settings)
        fast = model.generate(prompt, cache_implementation="static", compile_config=CompileConfig(backend="eager"), **settings)
        out["tokens"] = torch.equal(fast, expected)
    counts = []
    for m in (model, even):
        m.train()
        with tp.count_collectives() as c:
            m(input_ids=ids, labels=ids).loss.backward()
        counts.append((dict(c.forward), dict(c.backward)))
        m.zero_grad()
    out["counts"] = counts
    tp.save_sharded(model, f"{folder}/sharded")
    model.save_pretrained(f"{folder}/whole")  # gathered: the unsplit model's files (rank 0 writes)
    unsplit = copy.deepcopy(ref).train()
    out["losses"] = [tuple(row) for row in train_causal_lms([model, unsplit], [ids] * 3)]

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"],
                        init_lora_weights=False)
    torch.manual_seed(1)
    late = get_peft_model(tp.parallelize(copy.deepcopy(ref), world_mesh(), balance=True), config)
    late.save_pretrained(f"{folder}/adapter")  # every rank calls it; rank 0 writes
    dist.barrier()
    plain = PeftModel.from_pretrained(copy.deepcopy(ref), f"{folder}/adapter")
    with torch.no_grad():
        out["lora"] = err(late(input_ids=ids).logits, plain(input_ids=ids).logits)
    out["lora_width"] = late.get_submodule("base_model.model.model.layers.0.mlp.down_proj").lora_A["default"].in_features
    return out


def test_a_balanced_split_under_torchrun_computes_the_unsplit_models_numbers(pool2, tmp_path):
    from transformers import LlamaForCausalLM

    from support import tiny_llama

    results = pool2.run(balanced_task, str(tmp_path), timeout=180)
    for rank, out in enumerate(results):
        width = (112, 144)[rank]  # rank 0 holds 4 query heads, rank 1 two: rank 0 takes fewer MLP features
        assert out["widths"] == out["copy"] == [width, width]
        assert out["down"] == width and out["lora_width"] == width
        assert out["logits"] < 1e-5 and out["lora"] < 1e-5
        assert out["tokens"]
        assert out["counts"][0] == out["counts"][1]  # the collectives of the even split, forward and backward
        for got, want in out["losses"]:
            assert abs(got - want) <= 1e-4 * abs(want)
    ref = tiny_llama.build_uneven_heads()
    ids = torch.randint(0, tiny_llama.VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    three = tp.tensor_parallel(tiny_llama.build_uneven_heads(seed=5), ["cpu"] * 3)
    tp.load_sharded(three, tmp_path / "sharded", progress=False)
    plain = tiny_llama.build_uneven_heads(seed=5)
    tp.load_sharded(plain, tmp_path / "sharded", progress=False)
    whole = LlamaForCausalLM.from_pretrained(tmp_path / "whole")  # saved before training: ref's weights
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        for model in (three, plain, whole):
            got = model(input_ids=ids).logits
            assert ((got - want).norm() / want.norm()).item() < 1e-5
