"""The balanced split's sizes (plans/balance.py): water-filling over devices, multiples of 16 where that costs
under 1%, every device keeping a unit; which layers take them (the plain layers beside an attention whose heads
split unevenly, fused gate|up blocks alike); and that nothing else changes. Only the plan and the weight shapes
are read: SmolLM2-135M's shape is built on the meta device. Multi-device parity: tests/engines/*/test_*balance*."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import tensorshard as tp
from tensorshard.plans import resolve_plan
from tensorshard.plans.balance import balanced_sizes
from tensorshard.plans.sharding import shard_plan
from support.helpers import rel_err, split_copy


def test_water_filling_evens_the_loads_in_multiples_of_16_where_that_costs_little():
    # SmolLM2's block at 2 devices: attention 589,824 / 294,912 elements, 1,728 per MLP feature, 1536 features
    assert balanced_sizes([589_824, 294_912], 1_728, 1_536) == (688, 848)  # peaks 1,778,688 (0.5% above best)
    assert balanced_sizes([589_824, 294_912], 1_728, 1_536, align=1) == (683, 853)  # the best in whole features
    assert balanced_sizes([100, 0, 0], 3, 176) == (36, 70, 70)  # 16-multiples would peak 14% higher: whole features
    assert balanced_sizes([7, 7], 5, 64) == (32, 32)  # nothing to even: the even split
    assert balanced_sizes([5_000, 0], 1, 10) == (1, 9)  # every device keeps a unit


def smollm2_shape():
    config = transformers.LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, tie_word_embeddings=True,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def block_loads(model, sharded, layer: int = 0) -> list[int]:
    """Weight elements of each device's slices in block `layer`."""
    loads = [0] * sharded.world_size
    for name, ms in sharded.modules.items():
        if name.startswith(f"model.layers.{layer}."):
            for tname, (_, part) in ms.splits.items():
                numel = getattr(model.get_submodule(name), tname).numel()
                for r in range(sharded.world_size):
                    loads[r] += numel // part.size * part.local_size(r)
    return loads


def test_smollm2s_blocks_at_two_devices_even_out():
    model = smollm2_shape()
    plan = resolve_plan(model, None, 2)
    even, balanced = shard_plan(model, plan, 2), shard_plan(model, plan, 2, balance=True)
    assert block_loads(model, even) == [1_916_928, 1_622_016]  # 6 + 3 query heads, MLP 768 + 768
    assert block_loads(model, balanced) == [1_778_688, 1_760_256]  # MLP 688 + 848
    for proj in ("gate_proj", "up_proj", "down_proj"):
        ms = balanced.modules[f"model.layers.1.mlp.{proj}"]
        assert ms.plain_sizes == (688, 848)
        assert ms.splits["weight"][1].ranges == (((0, 688),), ((688, 1536),))
    changed = {n for n in even.modules if even.modules[n].splits != balanced.modules[n].splits}
    assert changed == {f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")}
    # at 3 devices the 3 KV heads split one each: nothing changes
    assert shard_plan(model, plan, 3, balance=True).tensors == shard_plan(model, plan, 3).tensors


def test_a_fused_gate_up_splits_both_blocks_alike_and_matches_its_reader():
    """Phi-3's gate_up_proj declares blocks (n, n): each half gets the same sizes, which down_proj reads
    (plans/validate.py compares them); the split model computes the unsplit model's logits."""
    torch.manual_seed(0)
    config = transformers.Phi3Config(vocab_size=96, hidden_size=96, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=6, num_key_value_heads=3, pad_token_id=0)
    ref = transformers.Phi3ForCausalLM(config).eval()
    model = split_copy(ref, 2, balance=True)
    gate_up = model.splits["model.layers.0.mlp.gate_up_proj.weight"][1]
    down = model.splits["model.layers.0.mlp.down_proj.weight"][1]
    assert down.ranges == (((0, 48),), ((48, 128),))  # device 0: the larger attention, fewer features
    assert gate_up.ranges == (((0, 48), (128, 176)), ((48, 128), (176, 256)))
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, copy.deepcopy(ref)(input_ids=ids).logits) < 1e-5


def test_balance_must_be_a_bool_in_every_entry_point():
    """Refused before anything else is looked at (no process group, mesh or file is needed to be told)."""
    for call in (lambda: tp.parallelize(nn.Linear(4, 4), None, balance=1),
                 lambda: tp.from_pretrained("no-such-folder", balance="on"),
                 lambda: tp.tensor_parallel(nn.Linear(4, 4), ["cpu"] * 2, balance=None)):
        with pytest.raises(TypeError, match=r"balance must be True or False, got .*; pass balance=True to even out"):
            call()
