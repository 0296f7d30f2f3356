"""Each style on each layer type it supports, against the unsplit layer (fp32, 1e-5 relative)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorshard as tp
from support.helpers import check_training_parity, rel_err, split_copy

pytestmark = pytest.mark.timeout(60)


class Pair(nn.Module):
    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        return self.second(F.gelu(self.first(x)))


@pytest.mark.parametrize("n", [2, 3])
def test_biases_are_split_with_columns_and_added_once_after_rows(n, gen):
    ref = Pair(nn.Linear(10, 14), nn.Linear(14, 6))
    model = split_copy(ref, n, plan={"first": tp.ColwiseParallel(), "second": tp.RowwiseParallel()})
    check_training_parity(ref, model, lambda: torch.randn(3, 10, generator=gen))


@pytest.mark.parametrize("n", [2, 3])
def test_gather_output_and_row_with_whole_input(n, gen):
    ref = Pair(nn.Linear(10, 14), nn.Linear(14, 6))
    model = split_copy(ref, n, plan={"first": tp.ColwiseParallel(gather_output=True), "second": tp.RowwiseParallel()})
    with tp.count_collectives() as c:
        x = torch.randn(3, 10, generator=gen, requires_grad=True)
        model(x).sum().backward()
    assert c.forward == {"all_gather": 1, "all_reduce": 1}  # gather, then the row layer splits locally
    assert c.backward == {"all_gather": 1, "all_reduce": 1}
    check_training_parity(ref, model, lambda: torch.randn(3, 10, generator=gen))


def test_hf_conv1d_in_both_directions(gen):
    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D
    ref = Pair(Conv1D(14, 10), Conv1D(10, 14))  # Conv1D(nf, nx): weight (nx, nf)
    model = split_copy(ref, 3, plan={"first": tp.ColwiseParallel(), "second": tp.RowwiseParallel()})
    assert model.module_shards[2].first.nf == 4 and model.module_shards[2].second.nx == 4
    check_training_parity(ref, model, lambda: torch.randn(2, 5, 10, generator=gen))


@pytest.mark.parametrize("split", ["vocab", "embedding"])
@pytest.mark.parametrize("n", [2, 3])
def test_embedding_split_by_vocab_or_dim(split, n, gen):
    ref = nn.Sequential(nn.Embedding(50, 12, padding_idx=30), nn.Linear(12, 4))
    model = split_copy(ref, n, plan={"0": tp.EmbeddingParallel(split=split)})
    expected = {"vocab": "all_reduce", "embedding": "all_gather"}[split]
    with tp.count_collectives() as c:
        model(torch.zeros(1, 1, dtype=torch.long))
    assert c.counts == {expected: 1}
    check_training_parity(ref, model, lambda: torch.randint(0, 50, (3, 7), generator=gen))
    ids = torch.full((1, 4), 30)  # the padding row gets no gradient, wherever it lives
    model.zero_grad()
    model(ids).sum().backward()
    shard = 1 if (split == "vocab" and n == 2) else 0
    assert model.module_shards[shard][0].weight.grad.abs().sum() == 0


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("split", ["vocab", "embedding"])
def test_embedding_bag(mode, split, gen):
    ref = nn.EmbeddingBag(40, 8, mode=mode)
    model = split_copy(ref, 3, plan={"": tp.EmbeddingParallel(split=split)})
    ids = torch.randint(0, 40, (10,), generator=gen)
    offsets = torch.tensor([0, 3, 3, 7])
    assert rel_err(model(ids, offsets), ref(ids, offsets)) < 1e-5
    two_d = torch.randint(0, 40, (4, 5), generator=gen)
    assert rel_err(model(two_d), ref(two_d)) < 1e-5


class Experts(nn.Module):
    """Fused experts stored as 3-D parameters, like transformers' MixtralExperts."""

    def __init__(self, n=3, dim=8, hidden=6):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(n, 2 * hidden, dim) / 3)
        self.down = nn.Parameter(torch.randn(n, dim, hidden) / 3)

    def forward(self, x, weights):  # x: (T, dim), weights: (T, n)
        out = 0
        for e in range(self.gate_up.shape[0]):
            gate, up = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
            out = out + F.linear(F.silu(gate) * up, self.down[e]) * weights[:, e : e + 1]
        return out


def test_shard_params_splits_fused_experts(gen):
    ref = Experts()
    plan = {"": tp.ShardParams(params={"gate_up": {"dim": 1, "blocks": [6, 6]}, "down": 2})}
    model = split_copy(ref, 2, plan=plan)
    x = torch.randn(5, 8, generator=gen)
    w = torch.rand(5, 3, generator=gen)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    with tp.count_collectives() as c:
        ya = model(xa, wa)
        ya.sum().backward()
    yb = ref(xb, wb)
    yb.sum().backward()
    assert rel_err(ya, yb) < 1e-5
    assert rel_err(wa.grad, wb.grad) < 1e-5 and rel_err(xa.grad, xb.grad) < 1e-5
    assert c.forward == {"all_reduce": 1} and c.backward == {"all_reduce": 2}  # x and the routing weights


def test_tied_weights_must_split_alike():
    emb = nn.Embedding(20, 8)
    head = nn.Linear(8, 20, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    with pytest.raises(ValueError, match="tied weights"):
        tp.tensor_parallel(model, ["cpu"] * 2, plan={"0": tp.EmbeddingParallel(split="embedding"), "1": tp.ColwiseParallel(gather_output=True)})
    assert not emb.weight.is_meta  # untouched
    split = tp.tensor_parallel(model, ["cpu"] * 2, plan={"0": tp.EmbeddingParallel(), "1": tp.ColwiseParallel(gather_output=True)})
    for shard in split.module_shards:
        assert shard[0].weight is shard[1].weight  # still tied, per device
