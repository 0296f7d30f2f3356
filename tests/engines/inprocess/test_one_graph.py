"""Shards that share one accelerator: their backward runs as ONE autograd graph spanning the shards.

On a GPU this placement is debug mode (every shard on the first GPU, whose single autograd thread cannot run the
shards' backward passes side by side). The collectives are then one node per call with an input and an output per
shard. Here it is simulated on CPU slots (the group told that its shards share a device), and must give what the
default placement (every shard its own graph) gives: the same gradients, bit for bit (both sum in rank order), and
the same collectives, forward and backward."""

import pytest
import torch

import tensorshard as tp
from tensorshard.comm import rendezvous
from support import plans
from support.helpers import split_copy
from support.models import FeedForward, TwoBlocks, TwoPairs, Transformer

pytestmark = pytest.mark.timeout(60)


def step(model, x) -> tuple[torch.Tensor, dict, tuple, tuple]:
    """Output, every shard's gradients, and the collectives of the forward and the backward pass."""
    with tp.count_collectives() as fwd:
        y = model(x)
    with tp.count_collectives() as bwd:
        y.square().mean().backward()
    grads = {(r, k): p.grad for r, s in enumerate(model.module_shards) for k, p in s.named_parameters()}
    return y.detach(), grads, (fwd.counts, fwd.bytes), (bwd.counts, bwd.bytes)


@pytest.mark.parametrize("n", [2, 3])
def test_a_transformer_trains_as_with_its_own_graphs(n, gen, monkeypatch):
    # n_kv_heads=2 over 3 devices: replicated KV heads, whose gradients `tie` sums over their holders
    ref = Transformer(n_kv_heads=2)
    tokens = torch.randint(0, 96, (2, 7), generator=gen)
    own = split_copy(ref, n, plan=plans.transformer(8, 2))
    expected = step(own, tokens)
    _span(monkeypatch)
    spanning = split_copy(ref, n, plan=plans.transformer(8, 2))
    assert not spanning._group.own_graphs
    got = step(spanning, tokens)
    _same(expected, got)
    if n == 3:
        assert got[3][0]["all_reduce"] > 4  # the ties' sums, beyond one per column -> row pair and embedding


@pytest.mark.parametrize("n", [2, 3])
def test_row_layers_reading_whole_inputs_split_them_as_with_their_own_graphs(n, gen, monkeypatch):
    # b1 and b2 read whole inputs: `split` keeps each device's slice, its backward gathers the gradient
    ref = TwoBlocks()
    x = torch.randn(4, 8, generator=gen)
    plan = {"b[12]": tp.RowwiseParallel()}
    expected = step(split_copy(ref, n, plan=plan), x.clone().requires_grad_())
    _span(monkeypatch)
    got = step(split_copy(ref, n, plan=plan), x.clone().requires_grad_())
    _same(expected, got)
    assert got[3][0] == {"all_gather": 2}



@pytest.mark.parametrize("n", [2, 3])
def test_lora_factors_beside_split_layers_sum_their_partial_gradients_as_with_their_own_graphs(n, gen, monkeypatch):
    # A LoRA factor stays whole beside a split layer and sees part of the computation: `partial_grads` sums its
    # gradients over the devices, once per backward pass for all of them
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # init_lora_weights=False: B is random too, so every factor gets a gradient
    ref = get_peft_model(FeedForward(16, 32), LoraConfig(r=2, target_modules=["w1", "w2", "w3"], init_lora_weights=False))
    plan = {"base_model.model.w[13]": tp.ColwiseParallel(), "base_model.model.w2": tp.RowwiseParallel()}
    x = torch.randn(4, 16, generator=gen)
    expected = step(split_copy(ref, n, plan=plan), x.clone().requires_grad_())
    _span(monkeypatch)
    got = step(split_copy(ref, n, plan=plan), x.clone().requires_grad_())
    _same(expected, got)
    assert got[3][0] == {"all_reduce": 2}  # the input's copy_to_parallel, and the partial gradients'



@pytest.mark.parametrize("n", [2, 3])
def test_zero3_gathers_its_rows_as_with_their_own_graphs(n, gen, monkeypatch):
    # sharded=True: the norm and the biases the plan leaves whole keep 1/n of their rows per device, gathered in
    # one all-gather per call; the gather's backward keeps each device's rows
    ref = TwoPairs()
    x = torch.randn(4, 8, generator=gen)
    expected = step(split_copy(ref, n, plan=plans.TWO_BLOCKS, sharded=True), x.clone().requires_grad_())
    _span(monkeypatch)
    got = step(split_copy(ref, n, plan=plans.TWO_BLOCKS, sharded=True), x.clone().requires_grad_())
    _same(expected, got)
    assert got[2][0] == {"all_gather": 1, "all_reduce": 2}


def _span(monkeypatch) -> None:
    init = rendezvous.ThreadGroup.__init__

    def shared(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.own_graphs = False

    monkeypatch.setattr(rendezvous.ThreadGroup, "__init__", shared)


def _same(expected, got) -> None:
    (y0, g0, f0, b0), (y1, g1, f1, b1) = expected, got
    assert torch.equal(y0, y1)
    assert g0.keys() == g1.keys()
    assert all((g0[k] is None and g1[k] is None) or torch.equal(g0[k], g1[k]) for k in g0), "gradients differ"
    assert f0 == f1 and b0 == b1
