"""Plans whose layouts cannot run are refused before the model changes (plans/validate.py, checks 5 and 6):
a ChannelParallel norm whose input is not split by a column layer, and q/k/v split column-wise inside a
module whose forward reads its own head count, with no Heads entry. The same models with the fixes the
messages name split and match the unsplit model (within 1e-5: only the reduction order differs)."""

import copy

import pytest
import torch
from torch import nn

import tensorshard as tp


class NormBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 8)

    def forward(self, x):
        return self.b(self.bn(self.a(x)))


class Attention(nn.Module):
    def __init__(self, dim: int = 24, n_heads: int = 6):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for y in (self.q(x), self.k(x), self.v(x)))
        y = nn.functional.scaled_dot_product_attention(q, k, v)  # (b, heads, t, head_dim)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()

    def forward(self, x):
        return x + self.attn(x)


def snapshot(model: nn.Module) -> dict:
    return {n: (id(t), t.detach().clone()) for n, t in [*model.named_parameters(), *model.named_buffers()]}


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, (ident, value) in before.items():
        assert after[name][0] == ident and torch.equal(after[name][1], value), name
    assert not any("forward" in vars(m) for m in model.modules())  # no style attached


@pytest.mark.parametrize("plan", [{"bn": tp.ChannelParallel()},
                                  {"bn": tp.ChannelParallel(), "b": tp.RowwiseParallel()},
                                  {"a": tp.ColwiseParallel(gather_output=True), "bn": tp.ChannelParallel()}])
def test_channel_parallel_on_a_whole_input_is_refused_before_the_model_changes(plan):
    torch.manual_seed(0)
    model = NormBetween()
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        tp.tensor_parallel(model, ["cpu"] * 2, plan=plan)
    message = str(info.value)
    assert "bn (ChannelParallel() on BatchNorm1d)" in message and "its input comes from a (Linear)" in message
    assert "ColwiseParallel() on a" in message and "drop the ChannelParallel entry for bn" in message
    assert_unchanged(model, before)


def test_channel_parallel_after_a_column_layer_runs_like_the_unsplit_model():
    torch.manual_seed(0)
    ref = NormBetween()
    plan = {"a": tp.ColwiseParallel(), "bn": tp.ChannelParallel(), "b": tp.RowwiseParallel()}
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plan)
    x = torch.randn(6, 8)
    torch.testing.assert_close(split(x), ref(x), rtol=1e-5, atol=1e-5)


def test_split_qkv_without_heads_under_a_head_count_is_refused_with_the_heads_entry():
    torch.manual_seed(0)
    model = Block()
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        tp.tensor_parallel(model, ["cpu"] * 2, plan={"attn.[qkv]": tp.ColwiseParallel(), "attn.o": tp.RowwiseParallel()})
    message = str(info.value)
    assert "attn (Attention) reads self.n_heads = 6" in message and "attn.q, attn.k, attn.v" in message
    assert "'attn': tp.Heads(num_heads=6, attrs={'n_heads': 'heads'})" in message
    assert_unchanged(model, before)

    fixed = {"attn": tp.Heads(num_heads=6, attrs={"n_heads": "heads"}),  # what the message says
             "attn.[qkv]": tp.ColwiseParallel(blocks=("q",)), "attn.o": tp.RowwiseParallel(blocks=("q",))}
    ref = Block()
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=fixed)
    x = torch.randn(2, 5, 24)
    torch.testing.assert_close(split(x), ref(x), rtol=1e-5, atol=1e-5)
