"""tensorshard.compat.Config: one rule kind of the tensor_parallel package per test, run at 2 CPU devices with
the unsplit model's numbers (1e-5 relative, float32), and the rules that are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tensorshard as ts
import tensorshard.compat as tp
from support.compat import MLP_RULES, W, FusedAttention, Net, ids
from support.helpers import rel_err
from support.models import ConvNet, Transformer

TOL = 1e-5  # float32, different summation order


def split(ref: nn.Module, config: tp.Config, **kwargs) -> nn.Module:
    return tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * W, tensor_parallel_config=config, sharded=False, **kwargs)


def train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(x).pow(2).mean().backward()
    opt.step()
    return model(x)


def test_split_0_split_1_scale_and_sum_on_the_parent(gen):
    """The original's MLP rules: fc1 split by rows, fc2 by columns with its bias scaled, 'sum' on the MLP."""
    torch.manual_seed(0)
    ref = Net()
    config = tp.Config(MLP_RULES, {}, {r"mlp$": {0: "sum"}}, {})
    plan = config.to_plan(ref, W)
    assert plan == ts.Plan({"mlp.fc1": ts.ColwiseParallel(), "mlp.fc2": ts.RowwiseParallel()})
    model = split(ref, config)
    x = ids(gen)
    assert rel_err(model(x), ref(x)) < TOL
    # The scaled bias is kept whole and added once: one optimizer step later, still the unsplit numbers
    # (a bias divided by 2 on each device would move twice as fast).
    assert rel_err(train_step(model, x), train_step(ref, x)) < 1e-4
    assert torch.equal(model.module_shards[1].mlp.fc2.bias, model.module_shards[0].mlp.fc2.bias)


def test_gather_on_a_column_layer(gen):
    torch.manual_seed(0)
    ref = Net()
    config = tp.Config({r"^head\.weight$": tp.Split(world_size=W, dim=0)}, {}, {r"^head$": {0: "gather -1"}}, {})
    assert config.to_plan(ref, W)["head"] == ts.ColwiseParallel(gather_output=True)
    model = split(ref, config)
    x = ids(gen)
    assert rel_err(model(x), ref(x)) < TOL
    assert model.module_shards[1].head.weight.shape == (20, 24)


def test_embedding_split_by_dimension_with_gather_and_tied_head_with_split_input(gen):
    """The original's automatic config for a tied output head: the embedding split along its dimension and
    gathered; the head (same weight: split by input features) splits its input and sums its output."""
    torch.manual_seed(0)
    ref = Net(tied=True)
    config = tp.Config(
        {r"embed\.weight$": "split 1"},
        {r"^head$": {0: tp.Split(world_size=W, dim=-1)}},
        {r"^embed$": {0: "gather -1"}, r"^head$": {0: "sum"}},
        {},
    )
    plan = config.to_plan(ref, W)
    assert plan == ts.Plan({"embed": ts.EmbeddingParallel(split="embedding"), "head": ts.RowwiseParallel()})
    model = split(ref, config)
    x = ids(gen)
    assert rel_err(model(x), ref(x)) < TOL
    assert model.module_shards[0].head.weight is model.module_shards[0].embed.weight  # still tied


def test_embedding_split_by_vocabulary_with_sum(gen):
    torch.manual_seed(0)
    ref = Net()
    config = tp.Config({r"embed\.weight$": "split 0"}, {}, {r"^embed$": {0: "sum"}}, {})
    assert config.to_plan(ref, W)["embed"] == ts.EmbeddingParallel(split="vocab")
    model = split(ref, config)
    x = ids(gen)
    assert rel_err(model(x), ref(x)) < TOL


def test_split_in_chunks_by_heads_with_scale_int_attributes(gen):
    """Grouped-query attention (8 query heads, 2 KV heads): q, k, v and o split in whole heads; the head
    counts the forward reshapes with divided by 'scale_int'."""
    torch.manual_seed(0)
    ref = Transformer(n_heads=8, n_kv_heads=2)
    hd = 8
    config = tp.Config(
        state_rules={
            r"attn\.w[qkv]\.weight$": tp.SplitInChunks(world_size=W, dim=0, chunk_size=hd),
            r"attn\.wo\.weight$": tp.SplitInChunks(world_size=W, dim=1, chunk_size=hd),
            r"ffn\.w[13]\.weight$": "split 0",
            r"ffn\.w2\.weight$": "split 1",
        },
        input_rules={},
        output_rules={r"\.attn$": {0: "sum"}, r"\.ffn\.w2$": {0: "sum"}},
        attr_rules={r"\.attn$": {"n_heads": "scale_int", "n_kv_heads": "scale_int"}},
    )
    plan = config.to_plan(ref, W)
    assert plan["layers.*.attn"] == ts.Heads(num_heads=8, num_kv_heads=2, attrs={"n_heads": "heads", "n_kv_heads": "kv_heads"})
    assert plan["layers.*.attn.wk"] == ts.ColwiseParallel(blocks=("kv",))
    model = split(ref, config)
    x = ids(gen, vocab=96)
    with ts.count_collectives() as c:
        out = model(x)
        out.pow(2).mean().backward()
    assert rel_err(out, ref(x)) < TOL
    assert model.module_shards[1].layers[0].attn.n_heads == 4
    # Each 'sum' is one all-reduce forward; each block's input read by split layers one backward: 2 + 2 per layer.
    assert c.forward == {"all_reduce": 4} and c.backward == {"all_reduce": 4}


def test_split_in_grouped_chunks_with_a_callable_attribute_rule(gen):
    """A fused q|k|v Linear: three groups, each split in whole heads (5 heads over 2 devices: 3 + 2), and
    the head count from a function of (value, rank), as the original's presets write it."""
    torch.manual_seed(0)
    ref = FusedAttention(dim=40, n_heads=5)
    config = tp.Config(
        state_rules={
            r"qkv\.(weight|bias)$": tp.SplitInGroupedChunks(world_size=W, dim=0, num_groups=3, chunk_size=8),
            r"proj\.weight$": tp.SplitInChunks(world_size=W, dim=1, chunk_size=8),
            r"proj\.bias$": tp.Scale(world_size=W),
        },
        input_rules={},
        output_rules={r"^proj$": {0: "sum"}},
        attr_rules={r"^$": {"n_heads": lambda n, rank: torch.empty(n).tensor_split(W)[rank].numel()}},
    )
    plan = config.to_plan(ref, W)
    assert plan["qkv"] == ts.ColwiseParallel(blocks=("q", "q", "q"))
    assert plan[""] == ts.Heads(num_heads=5, attrs={"n_heads": "heads"})
    model = split(ref, config)
    x = torch.randn(2, 7, 40, generator=gen)
    assert rel_err(model(x), ref(x)) < TOL
    assert [s.n_heads for s in model.module_shards] == [3, 2]
    # Each device holds the q, k and v of its own heads, as the original's action gives them.
    action = tp.SplitInGroupedChunks(world_size=W, dim=0, num_groups=3, chunk_size=8)
    assert torch.equal(model.module_shards[1].qkv.weight, action(ref.qkv.weight, 1))
    assert torch.equal(action.undo([action(ref.qkv.weight, r) for r in range(W)]), ref.qkv.weight)


def test_convolutions_split_by_channels(gen):
    torch.manual_seed(0)
    ref = ConvNet().eval()
    config = tp.Config(
        {r"^conv1\.(weight|bias)$": "split 0", r"^conv2\.weight$": "split 1", r"^conv2\.bias$": "scale"},
        {}, {r"^conv2$": {0: "sum"}}, {},
    )
    assert config.to_plan(ref, W) == ts.Plan({"conv1": ts.ColwiseParallel(), "conv2": ts.RowwiseParallel()})
    model = split(ref, config)
    x = torch.randn(2, 3, 8, 8, generator=gen)
    assert rel_err(model(x), ref(x)) < TOL


def test_a_config_is_accepted_by_the_class_and_by_plain_tensorshard_once_translated(gen):
    torch.manual_seed(0)
    ref = Net()
    config = tp.Config(MLP_RULES, {}, {r"mlp$": {0: "sum"}}, {})
    model = tp.TensorParallel(copy.deepcopy(ref), ["cpu"] * W, tensor_parallel_config=config, sharded=False)
    assert isinstance(model, tp.TensorParallel) and isinstance(model, ts.TensorParallel)
    x = ids(gen)
    assert rel_err(model(x), ref(x)) < TOL
    plain = ts.tensor_parallel(copy.deepcopy(ref), ["cpu"] * W, plan=config.to_plan(ref, W), sharded=False)
    assert rel_err(plain(x), ref(x)) < TOL
    assert ts.Plan.from_json(model.plan.to_json()) == model.plan  # printable, storable


# --- refusals ---------------------------------------------------------------------------------------------


def _legacy(tensor, rank):
    return tensor


REFUSED = {
    "callable state rule": (
        tp.Config({r"mlp\.fc1\.weight$": _legacy}, {}, {}, {}),
        r"state_rules\['mlp\\\\.fc1\\\\.weight\$'\] \(matches mlp.fc1.weight\): <function _legacy.*Python callable",
    ),
    "world size of the action": (
        tp.Config({r"mlp\.fc1\.(weight|bias)$": tp.Split(world_size=4, dim=0)}, {}, {}, {}),
        r"made for world_size=4, but the model is being split over 2 devices",
    ),
    "KV-cache plumbing": (
        tp.Config(MLP_RULES, {r"mlp$": {"layer_past": lambda kv, rank: kv}}, {r"mlp$": {0: "sum"}}, {}),
        r"input_rules for 'mlp', argument 'layer_past'.*delete it: each device keeps the cache of its own heads",
    ),
    "row layer without a sum": (
        tp.Config(MLP_RULES, {}, {}, {}),
        r"'mlp.fc2' is split by input features.*no output rule 'sum' covers it",
    ),
    "sum twice": (
        tp.Config(MLP_RULES, {}, {r"mlp$": {0: "sum"}, r"fc2$": {0: "sum"}}, {}),
        r"'sum' is applied 2 times \('mlp', 'mlp.fc2'\)",
    ),
    "sum over nothing split": (
        tp.Config({}, {}, {r"^norm$": {0: "sum"}}, {}),
        r"output rule 'sum' on 'norm': nothing inside it is split",
    ),
    "row bias kept whole": (
        tp.Config({r"mlp\.fc1\.(weight|bias)$": "split 0", r"mlp\.fc2\.weight$": "split 1"}, {}, {r"mlp$": {0: "sum"}}, {}),
        r"mlp.fc2 \(Linear\): the weight is split by input features .* but the bias is kept whole",
    ),
    "scaled weight": (
        tp.Config({r"norm\.weight$": "scale"}, {}, {}, {}),
        r"state rules on norm \(LayerNorm\) \(weight: 'scale'\): tensorshard.compat translates splits of the weight",
    ),
    "gather on a parent": (
        tp.Config({r"head\.weight$": "split 0"}, {}, {r"^$": {0: "gather -1"}}, {}),
        r"output rule 0: 'gather -1' on '', which the state rules do not split; put 'gather' on the split layer",
    ),
    "split dim out of range": (  # the original's torch.tensor_split raised; it must not become another dim
        tp.Config({r"mlp\.fc1\.weight$": tp.state_actions.Split(W, 2), r"mlp\.fc1\.bias$": "split 0"}, {}, {}, {}),
        r"mlp.fc1 \(Linear\): Split\(world_size=2, dim=2\) splits dim 2 of a 2-D weight; use a dim in \[-2, 1\]",
    ),
    "unknown attribute rule": (
        tp.Config({}, {}, {}, {r"^mlp$": {"dim": "halve"}}),
        r"attr_rules for 'mlp', 'dim': MLP has no attribute 'dim'",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_untranslatable_rules_are_refused_by_name_before_the_model_changes(case, gen):
    config, message = REFUSED[case]
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    with pytest.raises(tp.UntranslatableConfig, match=message):
        tp.tensor_parallel(model, ["cpu"] * W, tensor_parallel_config=config)
    x = ids(gen)
    assert torch.equal(model(x), ref(x))  # untouched, still usable


def test_several_problems_are_listed_at_once():
    config = tp.Config({r"norm\.weight$": "scale", r"mlp\.fc2\.weight$": "split 1", r"mlp\.fc2\.bias$": "scale"}, {}, {}, {})
    with pytest.raises(tp.UntranslatableConfig, match=r"^2 rule\(s\)"):
        config.to_plan(Net(), W)


def test_grouped_heads_the_original_would_split_inconsistently_are_refused():
    """6 query heads in 3 KV groups over 2 devices: the original cuts q 3 + 3 and k 2 + 1, so device 0's third
    query head has no KV head there; tensorshard would give q 4 + 2. The translation refuses, naming both."""
    ref = Transformer(n_heads=6, n_kv_heads=3, dim=48)
    config = tp.Config(
        {r"attn\.w[qkv]\.weight$": tp.SplitInChunks(world_size=W, dim=0, chunk_size=8),
         r"attn\.wo\.weight$": tp.SplitInChunks(world_size=W, dim=1, chunk_size=8)},
        {}, {r"\.attn$": {0: "sum"}}, {},
    )
    with pytest.raises(tp.UntranslatableConfig, match=r"layers.0.attn.wq.weight: the config's SplitInChunks.* gives the "
                       r"devices \[0..23, 24..47\] along dim 0; tensorshard's split would give \[0..31, 32..47\]"):
        config.to_plan(ref, W)


def test_bad_patterns_and_tables_fail_at_construction():
    with pytest.raises(ValueError, match=r"'\(' is not a valid regular expression"):
        tp.Config({"(": "split 0"}, {}, {}, {})
    with pytest.raises(TypeError, match=r"output_rules\['x'\] must map arguments to actions"):
        tp.Config({}, {}, {"x": "sum"}, {})


def test_attribute_rules_on_a_module_without_chunked_layers_set_per_device_values(gen):
    """Attention split with plain 'split 0' / 'split 1' (even head counts): no head geometry, so the head
    counts are set as the rules compute them (PerDeviceValues)."""
    torch.manual_seed(0)
    ref = Transformer(n_heads=8, n_kv_heads=4)
    config = tp.Config(
        {r"attn\.w[qkv]\.weight$": "split 0", r"attn\.wo\.weight$": "split 1"},
        {}, {r"attn\.wo$": {0: "sum"}},
        {r"\.attn$": {"n_heads": "scale_int", "n_kv_heads": lambda n, rank: n // W}},
    )
    plan = config.to_plan(ref, W)
    assert plan["layers.*.attn"] == tp.PerDeviceValues(values={"n_heads": (4, 4), "n_kv_heads": (2, 2)})
    assert ts.Plan.from_json(plan.to_json()) == plan
    model = split(ref, config)
    x = ids(gen, vocab=96)
    assert rel_err(model(x), ref(x)) < TOL
    with pytest.raises(ValueError, match=r"n_heads has values for 2 devices \(4, 4\), but the model is split over 3"):
        ts.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 3, plan=ts.Plan({"layers.*.attn": plan["layers.*.attn"]}))


def test_a_split_action_refuses_a_dimension_the_tensor_does_not_have():
    weight = torch.randn(4, 6)
    with pytest.raises(IndexError, match=r"Dimension out of range \(expected to be in range of \[-2, 1\], but got 2\)"):
        tp.state_actions.Split(2, 2)(weight, 0)  # before: dim 0's first half
    assert torch.equal(tp.state_actions.Split(2, -1)(weight, 1), weight[:, 3:])


def test_rules_that_match_nothing_are_named_in_a_warning(caplog):
    config = tp.Config(dict(MLP_RULES, **{r"^nowhere\.weight$": "split 0"}), {r"^nope$": {0: "split -1"}},
                       {r"mlp$": {0: "sum"}, r"^none$": {0: "gather -1"}}, {r"^absent$": {"n": "scale_int"}})
    with caplog.at_level("WARNING", logger="tensorshard.compat.config_to_plan"):
        config.to_plan(Net(), W)
    said = caplog.text
    assert "state rules that match no parameter or buffer: ['^nowhere\\\\.weight$']" in said
    assert "input rules that match no module: ['^nope$']" in said
    assert "output rules that match no module: ['^none$']" in said
    assert "attr rules that match no module: ['^absent$']" in said
