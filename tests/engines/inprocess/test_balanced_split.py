"""`balance=True` in one process: a GQA Llama whose 3 KV heads split 2 + 1 over 2 devices gets its MLP split
unevenly, the lighter attention's device taking more features, so each device's weights over a block are even;
the model still computes the unsplit model's numbers (logits within 1e-5 relative, training losses within 1e-4),
with the collectives of the even split, on the fast decoding path too, with LoRA before or after splitting, and
through checkpoints reloaded at another device count and unsplit. Models whose heads split evenly are unchanged.
The sizes themselves (water-filling) are unit-tested in tests/plans/test_balance.py."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CompileConfig

import tensorshard as tp
from support import tiny_llama
from support.helpers import rel_err, split_copy, train_both_causal_lm

pytestmark = pytest.mark.timeout(240)

MLP = ("gate_proj", "up_proj", "down_proj")


def ids(seed: int = 2, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, tiny_llama.VOCAB, (batch, 7), generator=torch.Generator().manual_seed(seed))


def block_elements(model, layer: int = 0) -> list[int]:
    """Weight elements each device holds in block `layer` (attention and MLP projections)."""
    out = []
    for shard in model.module_shards:
        block = shard.model.layers[layer]
        out.append(sum(m.weight.numel() for m in (*(getattr(block.self_attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
                                                   *(getattr(block.mlp, p) for p in MLP))))
    return out


def mlp_widths(model, layer: int = 0) -> list[int]:
    return [shard.model.layers[layer].mlp.gate_proj.out_features for shard in model.module_shards]


@pytest.fixture(scope="module")
def ref():
    return tiny_llama.build_uneven_heads()


def test_the_mlp_evens_out_the_block_and_the_model_computes_the_unsplit_numbers(ref):
    even = split_copy(ref, 2)
    balanced = split_copy(ref, 2, balance=True)
    # Attention: device 0 holds 2 KV groups (4 query heads), device 1 one (2): 18,432 and 9,216 elements. The MLP's
    # 256 features (288 elements each: gate row, up row, down column) split 128 / 128 leave 55,296 / 46,080.
    assert mlp_widths(even) == [128, 128] and block_elements(even) == [55_296, 46_080]
    # Balanced: 112 / 144 (multiples of 16) make both 50,688.
    assert mlp_widths(balanced) == [112, 144] and block_elements(balanced) == [50_688, 50_688]
    for shard in balanced.module_shards:  # every plain layer of the block alike: down reads what gate and up make
        mlp = shard.model.layers[1].mlp
        assert mlp.up_proj.out_features == mlp.down_proj.in_features == mlp.gate_proj.out_features
    with torch.no_grad(), tp.count_collectives() as counted:
        logits = balanced(input_ids=ids()).logits
    with torch.no_grad(), tp.count_collectives() as counted_even:
        even(input_ids=ids())
    assert rel_err(logits, ref(input_ids=ids()).logits) < 1e-5  # fp32, sums in another order
    assert counted.counts == counted_even.counts  # the same collectives: 2 all-reduces a block, the head's gather


def test_a_balanced_split_trains_like_the_unsplit_model(ref):
    unsplit = copy.deepcopy(ref).train()
    model = split_copy(unsplit, 2, balance=True)
    with tp.count_collectives() as counted:
        model(input_ids=ids(), labels=ids()).loss.backward()
    even = split_copy(unsplit, 2)
    with tp.count_collectives() as counted_even:
        even(input_ids=ids(), labels=ids()).loss.backward()
    assert counted.counts == counted_even.counts
    model.zero_grad()
    for got, want in train_both_causal_lm(model, unsplit, [ids(10 + step) for step in range(3)]):
        assert abs(got - want) <= 1e-4 * abs(want)  # three AdamW steps, fp32


def test_replicated_kv_heads_at_three_devices_balance_too():
    """6 query heads over 2 KV heads at 3 devices: KV head 0 is held by devices 0 and 1 (2 + 1 of its query heads),
    KV head 1 by device 2 (3): attention weights 9,216 / 6,144 / 12,288 elements."""
    ref = tiny_llama.build_uneven_heads(kv_heads=2)
    even, balanced = split_copy(ref, 3), split_copy(ref, 3, balance=True)
    assert block_elements(even) == [9_216 + 86 * 288, 6_144 + 85 * 288, 12_288 + 85 * 288]  # 33,984 / 30,624 / 36,768
    # water level 33,792 each: 85.3 / 96 / 74.7 features; whole features (16-multiples would be 4% worse)
    assert mlp_widths(balanced) == [85, 96, 75]
    assert block_elements(balanced) == [33_696, 33_792, 33_888]
    with torch.no_grad():
        assert rel_err(balanced(input_ids=ids()).logits, ref(input_ids=ids()).logits) < 1e-5


def test_heads_that_split_evenly_leave_the_split_as_it_was(ref):
    """3 KV heads over 3 devices: one each, so every block is even already; balance=True changes nothing."""
    even, balanced = split_copy(ref, 3), split_copy(ref, 3, balance=True)
    assert even.splits == balanced.splits and mlp_widths(balanced) == [86, 85, 85]


def test_the_fast_decoding_path_gives_the_unsplit_tokens(ref):
    prompt = ids(batch=1)
    settings = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    model = split_copy(ref, 2, balance=True)
    with torch.no_grad():
        expected = ref.generate(prompt, **settings)
        # dynamo's graphs as captured (backend "eager"): the shapes that differ per device are what is tested here
        out = model.generate(prompt, cache_implementation="static", compile_config=CompileConfig(backend="eager"), **settings)
    assert torch.equal(out, expected)
    assert model.__dict__.get("_tensorshard_compiled_steps"), "the fast path did not compile the decode step"


def test_lora_follows_the_balanced_split_before_and_after_splitting(ref, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", *MLP], init_lora_weights=False)
    torch.manual_seed(1)
    unsplit = get_peft_model(copy.deepcopy(ref), config)
    before = split_copy(unsplit, 2, balance=True)  # adapter first, then the split
    torch.manual_seed(1)
    after = get_peft_model(split_copy(ref, 2, balance=True), config)  # split first: PEFT adds to every device
    after.save_pretrained(tmp_path / "adapter")
    again = PeftModel.from_pretrained(copy.deepcopy(ref), tmp_path / "adapter")
    for model, prefix in ((before, "base_model.model."), (after, "")):  # a PeftModel split, or a split model's
        for shard, width in zip(model.module_shards, (112, 144)):
            mlp = shard.get_submodule(f"{prefix}model.layers.0.mlp")
            assert mlp.gate_proj.lora_B["default"].out_features == mlp.down_proj.lora_A["default"].in_features == width
    with torch.no_grad():
        want = unsplit(input_ids=ids()).logits
        assert rel_err(before(input_ids=ids()).logits, want) < 1e-5
        assert rel_err(after(input_ids=ids()).logits, again(input_ids=ids()).logits) < 1e-5


def test_a_checkpoint_saved_balanced_reloads_at_three_devices_and_unsplit(ref, tmp_path):
    from transformers import LlamaForCausalLM

    model = split_copy(ref, 2, balance=True)
    tp.save_sharded(model, tmp_path / "sharded")
    model.save_pretrained(tmp_path / "whole")  # the unsplit model's files, gathered
    want = ref(input_ids=ids()).logits.detach()
    three = split_copy(tiny_llama.build_uneven_heads(seed=5), 3)
    tp.load_sharded(three, tmp_path / "sharded", progress=False)
    plain = tiny_llama.build_uneven_heads(seed=5)
    tp.load_sharded(plain, tmp_path / "sharded", progress=False)
    whole = LlamaForCausalLM.from_pretrained(tmp_path / "whole")
    copied = copy.deepcopy(model)  # a second balanced split
    with torch.no_grad():
        for other in (three, plain, whole, copied):
            assert rel_err(other(input_ids=ids()).logits, want) < 1e-5
    assert mlp_widths(copied) == [112, 144]


def test_balance_must_be_a_bool(ref):
    with pytest.raises(TypeError, match=r"balance must be True or False, got 'yes' \(str\); pass balance=True"):
        tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, balance="yes")
