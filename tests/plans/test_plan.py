import pytest
from torch import nn

import tensorshard as tp
from tensorshard.plans.plan import match_pattern
from support.models import Transformer


def test_globs_match_segment_by_segment():
    assert match_pattern("layers.*.attn.wq", "layers.0.attn.wq")
    assert not match_pattern("layers.*.wq", "layers.0.attn.wq")  # * stays inside one segment
    assert match_pattern("**.wq", "layers.0.attn.wq")
    assert match_pattern("layers.*.ffn.w[13]", "layers.1.ffn.w3")
    assert not match_pattern("layers.*.ffn.w[13]", "layers.1.ffn.w2")


def test_first_matching_entry_wins_and_replicate_covers_children():
    model = Transformer()
    plan = tp.Plan({
        "layers.0": tp.Replicate(),
        "layers.*.ffn.w2": tp.RowwiseParallel(),
        "**.w2": tp.ColwiseParallel(),
    })
    assigned = plan.assign(model)
    assert "layers.0.ffn.w2" not in assigned  # inside a replicated module
    assert isinstance(assigned["layers.1.ffn.w2"].style, tp.RowwiseParallel)


def test_pattern_matching_nothing_names_closest_modules():
    with pytest.raises(ValueError) as info:
        tp.Plan({"layers.*.ffn.w4": tp.ColwiseParallel()}).assign(Transformer())
    assert "layers.*.ffn.w4" in str(info.value) and "Closest module names" in str(info.value)


def test_plan_round_trips_through_json(tmp_path):
    plan = tp.Plan({
        "layers.*.attn": tp.Heads(num_heads=8, num_kv_heads=2, attrs={"n_heads": "heads"}),
        "layers.*.attn.wq": tp.ColwiseParallel(blocks=("q",)),
        "layers.*.mlp.gate_up": tp.ColwiseParallel(blocks=(176, 176)),
        "layers.*.attn.wo": tp.RowwiseParallel(blocks=("q",)),
        "emb": tp.EmbeddingParallel(split="embedding"),
        "experts": tp.ShardParams(params={"w": {"dim": 1, "blocks": [4, 4]}, "v": 2}),
        "head": tp.ColwiseParallel(gather_output=True),
        "norm": tp.Replicate(),
    })
    path = tmp_path / "plan.json"
    plan.save(path)
    assert tp.Plan.load(path) == plan
    table = str(plan)
    assert "ColwiseParallel(blocks=('q',))" in table and "layers.*.attn.wo" in table


def test_bad_plans_are_rejected_with_the_fix():
    with pytest.raises(TypeError, match="use a tensorshard style"):
        tp.Plan({"w1": "colwise"})
    with pytest.raises(ValueError, match="unknown style"):
        tp.Plan.from_dict({"format": "tensorshard.plan/1", "entries": [{"pattern": "a", "style": "diagonal"}]})
    with pytest.raises(ValueError, match="no option"):
        tp.Plan.from_dict({"format": "tensorshard.plan/1", "entries": [{"pattern": "a", "style": "colwise", "gather": 1}]})
    with pytest.raises(ValueError, match="not a tensorshard plan"):
        tp.Plan.from_dict({"entries": []})


def test_style_on_unsupported_layer_is_a_clear_error():
    model = nn.Sequential(nn.LayerNorm(8))
    with pytest.raises(NotImplementedError, match="Replicate"):
        tp.tensor_parallel(model, ["cpu"] * 2, plan={"0": tp.ColwiseParallel()})
    assert not model[0].weight.is_meta  # the model is left as it was
