"""A hand-written plan's column/row pairs are checked like an inferred plan's (plan_inference/plancheck.py), in
one process at 2 and 3 devices: per op between a hand-placed ColwiseParallel and its RowwiseParallel partner
(tests/support/plan_pairs.py), the split either matches the unsplit model (fp32, 1e-5 relative: only the
reduction order differs) or is refused before the model changes, naming the module path, the op and the fix.
With check=True a refused pair stays whole instead, and the model matches exactly."""

import copy
import logging

import pytest
import torch

import tensorshard as tp
from support.helpers import rel_err
from support.plan_pairs import CASES, build, example, split_layers
from support.workers_state import assert_unchanged, snapshot

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_pair_is_exact_or_refused_at_split_time(name, world):
    ref, plan, verdict, op = build(name)
    x = example(name)
    model = copy.deepcopy(ref)
    if verdict == "refused":
        before = snapshot(model)
        with pytest.raises(ValueError) as info:
            tp.tensor_parallel(model, ["cpu"] * world, plan=plan)
        message = str(info.value)
        assert "'up' and 'down'" in message and "in mid (" in message and op in message, message
        assert "Fix:" in message and "check=True" in message
        assert_unchanged(model, before)
        return
    split = tp.tensor_parallel(model, ["cpu"] * world, plan=plan)
    assert all(split.splits[f"{layer}.weight"] is not None for layer in split_layers(name))
    assert rel_err(split(x), ref(x)) < 1e-5


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_check_true_keeps_a_failing_pair_whole(name, world, caplog):
    ref, plan, verdict, _ = build(name)
    x = example(name)
    with caplog.at_level(logging.WARNING, logger="tensorshard"):
        split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * world, plan=plan, check=True)
    assert rel_err(split(x), ref(x)) < 1e-5
    whole = [layer for layer in split_layers(name) if split.splits[f"{layer}.weight"] is None]
    kept = [r.getMessage() for r in caplog.records if "kept whole" in r.getMessage()]
    if verdict == "refused":
        assert whole == split_layers(name) and split.splits["down.weight"] is None
        assert any("'up' and 'down'" in line for line in kept), kept
    else:
        assert not whole and not kept
    # warnings name modules by their path in the model, never the self-check's copy ("inner")
    assert not any("inner" in r.getMessage() for r in caplog.records)


def test_the_issue_example_softmax_in_a_sequential_is_refused_or_kept_whole():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Softmax(-1), torch.nn.Linear(256, 64))
    plan = {"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()}
    with pytest.raises(ValueError, match=r"'0' and '2': in 1 \(Softmax\), softmax"):
        tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plan)
    x = torch.randn(4, 64)
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plan, check=True)
    assert rel_err(split(x), ref(x)) < 1e-6
    trusted = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plan, check=False)  # the user's word
    assert rel_err(trusted(x), ref(x)) > 1e-2  # what the check prevents


def test_a_model_the_trace_cannot_run_is_split_with_a_warning(caplog):
    class NeedsScale(torch.nn.Module):  # its forward needs an argument no synthetic input provides
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x, scale):
            return self.down(torch.relu(self.up(x)) * scale)

    torch.manual_seed(0)
    ref = NeedsScale()
    with caplog.at_level(logging.WARNING, logger="tensorshard"):
        split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan={"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()})
    assert any("could not verify the plan's column/row pairs on NeedsScale" in r.getMessage() for r in caplog.records)
    x = torch.randn(3, 8)
    assert rel_err(split(x, 0.5), ref(x, 0.5)) < 1e-5


@pytest.mark.parametrize("world", [2, 3])
def test_every_preset_passes_the_pair_check(world):
    """The hand-written presets, given as plans, trace and pass (no false refusal): every family of the
    suite's tiny transformers models."""
    pytest.importorskip("transformers")
    from support.hf_configs import FAMILIES, tiny_model
    from tensorshard.plan_inference.plancheck import plan_problems
    from tensorshard.plans.presets import preset_for
    from tensorshard.plans.sharding import shard_plan

    checked = []
    for family in FAMILIES:
        model = tiny_model(family)
        plan = preset_for(model)
        if plan is None:
            continue
        problems = plan_problems(model, shard_plan(model, plan, world))  # raises if the model does not trace
        assert problems == [], (family, [p.line() for p in problems])
        checked.append(family)
    assert len(checked) >= 15, checked


@pytest.mark.parametrize("name", ["softmax", "gate * up", "attention with Heads"])
def test_big_models_are_checked_on_an_empty_meta_copy(name, monkeypatch):
    """Past META_TRACE_BYTES of weights the trace runs on a meta-device copy (no weight read): same verdicts,
    and the model is not touched."""
    from tensorshard.plan_inference import plancheck

    monkeypatch.setattr(plancheck, "META_TRACE_BYTES", 0)
    traced = []
    real = plancheck._plan_problems
    monkeypatch.setattr(plancheck, "_plan_problems", lambda m, *a: traced.append(m) or real(m, *a))
    ref, plan, verdict, _ = build(name)
    x = example(name)
    model = copy.deepcopy(ref)
    if verdict == "refused":
        with pytest.raises(ValueError, match="'up' and 'down'"):
            tp.tensor_parallel(model, ["cpu"] * 2, plan=plan)
    else:
        assert rel_err(tp.tensor_parallel(model, ["cpu"] * 2, plan=plan)(x), ref(x)) < 1e-5
    assert traced and all(p.is_meta for p in traced[0].parameters())


N_HEADS, HEAD_DIM = 4, 16  # the model's sizes, as a script's constants


class _Attention(torch.nn.Module):
    """A hand-written attention (PyTorch's TP tutorial's shape): q, k and v reshaped into heads by a count:
    N_HEADS, the script's constant (`heads="constant"`), or -1."""

    def __init__(self, heads: str) -> None:
        super().__init__()
        self.n_heads, self.count = N_HEADS, N_HEADS if heads == "constant" else -1
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(64, 64, bias=False) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape  # noqa: N806
        q, k, v = (w(x).view(B, T, self.count, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, head_dim)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class _AttentionByHeadCount(_Attention):
    """The issue's code: `view(B, T, self.n_heads, head_dim)`."""

    def forward(self, x):
        B, T, _ = x.shape  # noqa: N806
        q, k, v = (w(x).view(B, T, self.n_heads, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


_ATTENTION_PLAN = {"attn.w[qkv]": tp.ColwiseParallel(), "attn.wo": tp.RowwiseParallel()}


class _Block(torch.nn.Module):
    def __init__(self, heads: str) -> None:
        super().__init__()
        self.attn = _AttentionByHeadCount(heads) if heads == "n_heads" else _Attention(heads)

    def forward(self, x):
        return x + self.attn(x)


@pytest.mark.parametrize("world", [2, 4])  # (4 heads over 3 devices would cut a head: refused for that first)
@pytest.mark.parametrize("heads", ["n_heads", "constant"])
def test_heads_made_with_the_whole_head_count_are_refused_at_split_time(heads, world):
    """Issue 40: accepted before, the first call raised `shape '[2, 8, 4, 16]' is invalid for input of size 512`
    from the model's own code. `self.n_heads` is read in the forward's source (plans/validate.py); a count that
    comes from anywhere else shows in the traced reshape itself (plan_inference/head_counts.py)."""
    torch.manual_seed(0)
    model = _Block(heads)
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        tp.tensor_parallel(model, ["cpu"] * world, plan=_ATTENTION_PLAN)
    message = str(info.value)
    assert "attn (_Attention" in message and "tp.Heads(num_heads=4" in message, message  # the module, the fix
    if heads == "constant":
        assert "'attn.wq' and 'attn.wo'" in message and "view(2, 5, 4, 16) reshapes" in message  # the pair, the op
        assert "into 4 heads of 16: the model's whole head count" in message and "view(..., -1, 16)" in message
    assert_unchanged(model, before)


def test_the_same_attention_reshaped_with_minus_one_is_accepted_and_exact(gen):
    torch.manual_seed(0)
    ref = _Block("-1")
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=_ATTENTION_PLAN)
    assert all(split.splits[f"attn.{w}.weight"] is not None for w in ("wq", "wk", "wv", "wo"))
    x = torch.randn(2, 8, 64, generator=gen)
    assert rel_err(split(x), ref(x)) < 1e-5


# Head counts the code computes from a size: from the reshaped (split) tensor's own, right on every device; from the
# attention's whole input, the model's whole count (head_counts.py's FeatureSize).
_SPELLINGS = {
    "t.size(-1) // hd": lambda t, x, B, T: t.view(B, T, t.size(-1) // HEAD_DIM, HEAD_DIM),  # noqa: N803
    "C // hd, C from t.size()": lambda t, x, B, T: t.view(B, T, t.size()[2] // HEAD_DIM, HEAD_DIM),  # noqa: N803
    "C // hd, C from t.shape": lambda t, x, B, T: t.view(B, T, t.shape[-1] // HEAD_DIM, HEAD_DIM),  # noqa: N803
    "reshape(B, T, -1, hd)": lambda t, x, B, T: t.reshape(B, T, -1, HEAD_DIM),  # noqa: N803
    "x.size(-1) // hd (whole input)": lambda t, x, B, T: t.view(B, T, x.size(-1) // HEAD_DIM, HEAD_DIM),  # noqa: N803
}


class _AttentionBySize(torch.nn.Module):
    """The hand-written attention, its heads counted by one of `_SPELLINGS`."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.heads = _SPELLINGS[spelling]
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(64, 64, bias=False) for _ in range(4))

    def forward(self, x):
        B, T, C = x.size()  # noqa: N806
        q, k, v = (self.heads(w(x), x, B, T).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class _BlockBySize(torch.nn.Module):
    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.attn = _AttentionBySize(spelling)

    def forward(self, x):
        return x + self.attn(x)


@pytest.mark.parametrize("spelling", [s for s in _SPELLINGS if "whole" not in s])
def test_heads_counted_from_the_split_tensors_own_size_are_accepted_and_exact(spelling, gen):
    """`view(B, T, C // head_dim, head_dim)` with C the reshaped tensor's own size divides each device's own
    features: right on a shard, so the plan check accepts it (it refused every explicit count before)."""
    torch.manual_seed(0)
    ref = _BlockBySize(spelling)
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=_ATTENTION_PLAN)
    assert all(split.splits[f"attn.{w}.weight"] is not None for w in ("wq", "wk", "wv", "wo"))
    x = torch.randn(2, 8, 64, generator=gen)
    assert rel_err(split(x), ref(x)) < 1e-5


def test_heads_counted_from_the_whole_input_are_refused_at_split_time():
    """`x.size(-1) // head_dim`, x the attention's whole input, is the model's whole head count on every device."""
    torch.manual_seed(0)
    model = _BlockBySize("x.size(-1) // hd (whole input)")
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        tp.tensor_parallel(model, ["cpu"] * 2, plan=_ATTENTION_PLAN)
    message = str(info.value)
    assert "attn (_AttentionBySize" in message and "tp.Heads(num_heads=4" in message, message  # the module, the fix
    assert "view(2, 5, 4, 16) reshapes" in message and "view(..., -1, 16)" in message, message  # the op, the fix
    assert_unchanged(model, before)
