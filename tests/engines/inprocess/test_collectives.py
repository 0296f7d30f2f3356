"""The minimum of communication: one all-reduce forward and one backward per column -> row pair."""

import pytest
import torch

import tensorshard as tp
from support import plans
from support.helpers import split_copy
from support.models import Block, FeedForward, Transformer

pytestmark = pytest.mark.timeout(60)


def forward_backward_counts(model, x):
    with tp.count_collectives() as fwd:
        y = model(x)
    with tp.count_collectives() as bwd:
        y.square().mean().backward()
    return fwd, bwd


@pytest.mark.parametrize("n", [2, 3, 4])
def test_feed_forward_costs_one_all_reduce_each_way(n, gen):
    model = split_copy(FeedForward(64, 176), n, plan=plans.FEED_FORWARD)
    x = torch.randn(4, 64, generator=gen, requires_grad=True)
    fwd, bwd = forward_backward_counts(model, x)
    assert fwd.counts == {"all_reduce": 1} and bwd.counts == {"all_reduce": 1}
    assert fwd.bytes == 4 * 64 * 4  # the (4, 64) fp32 output, once


def test_transformer_block_costs_two_all_reduces_each_way(gen):
    plan = {k.removeprefix("layers.*."): v for k, v in plans.transformer(8, 4).items() if k.startswith("layers")}
    model = split_copy(Block(64, 8, 4, 176), 2, plan=plan)
    x = torch.randn(2, 9, 64, generator=gen, requires_grad=True)
    fwd, bwd = forward_backward_counts(model, x)
    assert fwd.counts == {"all_reduce": 2} and bwd.counts == {"all_reduce": 2}
    assert fwd.bytes == bwd.bytes == 2 * (2 * 9 * 64 * 4)


@pytest.mark.parametrize("layers", [1, 3])
def test_whole_model_adds_only_embedding_and_head(layers, gen):
    model = split_copy(Transformer(n_layers=layers, n_heads=8, n_kv_heads=2), 2, plan=plans.transformer(8, 2))
    fwd, bwd = forward_backward_counts(model, torch.randint(0, 96, (2, 9), generator=gen))
    # forward: vocab-parallel embedding (1) + 2 per block; output head gathered (1 all-gather)
    assert fwd.counts == {"all_reduce": 1 + 2 * layers, "all_gather": 1}
    # backward: 2 per block + the output head's input
    assert bwd.counts == {"all_reduce": 2 * layers + 1}


def test_no_collectives_at_one_device(gen):
    model = split_copy(FeedForward(16, 32), 1, plan=plans.FEED_FORWARD)
    fwd, bwd = forward_backward_counts(model, torch.randn(2, 16, generator=gen, requires_grad=True))
    assert fwd.counts == {} and bwd.counts == {}


def test_inference_needs_no_backward_collectives(gen):
    model = split_copy(FeedForward(16, 32), 2, plan=plans.FEED_FORWARD)
    with torch.no_grad(), tp.count_collectives() as c:
        model(torch.randn(2, 16, generator=gen))
    assert c.counts == {"all_reduce": 1} and not c.backward
