"""Split models train and infer like the unsplit model (fp32: forward 1e-5, after 3 AdamW steps 1e-4)."""

import pytest
import torch
from torch import nn

import tensorshard as tp
from support import plans
from support.helpers import check_training_parity, split_copy
from support.models import ConvNet, FeedForward, Transformer

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_feed_forward(n, gen):
    ref = FeedForward(64, 176)  # 176 on 3 devices: 59 + 59 + 58
    model = split_copy(ref, n, plan=plans.FEED_FORWARD)
    check_training_parity(ref, model, lambda: torch.randn(4, 7, 64, generator=gen))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_transformer_with_grouped_kv_heads(n, gen):
    ref = Transformer(dim=64, n_heads=8, n_kv_heads=2, hidden=176)  # n=3, 4: KV heads replicated
    model = split_copy(ref, n, plan=plans.transformer(8, 2))
    check_training_parity(ref, model, lambda: torch.randint(0, 96, (2, 9), generator=gen))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_conv_net(n, gen):
    ref = ConvNet(channels=12)
    model = split_copy(ref, n, plan=plans.CONV_NET)
    check_training_parity(ref, model, lambda: torch.randn(3, 3, 6, 6, generator=gen))


@pytest.mark.parametrize(
    "n_heads, n_kv_heads, dim, n",
    [
        (9, 9, 72, 2),  # 9 heads on 2 devices: 5 + 4
        (8, 2, 64, 4),  # 2 KV heads on 4 devices: each KV head on two devices
        (9, 3, 72, 2),  # SmolLM2's grouping: 3 groups of 3 on 2 devices: 6 + 3 query heads
        (9, 3, 72, 4),  # ... on 4: KV head 0 shared by two devices (2 + 1 query heads)
        (6, 6, 48, 4),  # 6 heads on 4: 2 + 2 + 1 + 1
    ],
)
def test_uneven_and_grouped_heads(n_heads, n_kv_heads, dim, n, gen):
    # Seeded like its twin below: with an unseeded init, AdamW's first step (which divides by tiny
    # gradient magnitudes) occasionally amplified float rounding past the tolerance (seen 1 run in ~10).
    torch.manual_seed(0)
    ref = Transformer(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, hidden=176)
    model = split_copy(ref, n, plan=plans.transformer(n_heads, n_kv_heads))
    check_training_parity(ref, model, lambda: torch.randint(0, 96, (2, 9), generator=gen))


def test_input_gradients_match(gen):
    """An input that needs a gradient gets exactly the unsplit model's (not N times it)."""
    ref = FeedForward(32, 64)
    model = split_copy(ref, 3, plan=plans.FEED_FORWARD)
    x = torch.randn(5, 32, generator=gen)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(xa).sum().backward()
    ref(xb).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        torch.cat([s.w1.weight.grad for s in model.module_shards]), ref.w1.weight.grad, rtol=1e-5, atol=1e-6
    )


def test_replicated_parameters_get_full_gradients_and_stay_identical(gen):
    """The tensor_parallel package gives each LayerNorm copy a partial gradient; here every copy gets all of it."""
    ref = Transformer(dim=64, n_heads=8, n_kv_heads=2)
    model = split_copy(ref, 2, plan=plans.transformer(8, 2))
    tokens = torch.randint(0, 96, (2, 9), generator=gen)
    model(tokens).square().mean().backward()
    ref(tokens).square().mean().backward()
    for shard in model.module_shards:
        torch.testing.assert_close(shard.layers[0].ffn_norm.weight.grad, ref.layers[0].ffn_norm.weight.grad, rtol=1e-4, atol=1e-7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    opt.step()
    a, b = (s.layers[1].attn_norm.weight for s in model.module_shards)
    assert torch.equal(a, b)  # copies are bit-identical after the step


def test_output_device_and_eval_mode(gen):
    ref = Transformer()
    model = split_copy(ref, 2, plan=plans.transformer(8, 2), output_device="cpu")
    model.eval()
    assert all(not m.training for s in model.module_shards for m in s.modules())
    tokens = torch.randint(0, 96, (1, 5), generator=gen)
    with torch.no_grad():
        out = model(tokens)
    assert out.device == torch.device("cpu") and not out.requires_grad


def test_wrapper_keeps_the_module_mode():
    ref = Transformer().eval()
    model = split_copy(ref, 2, plan=plans.transformer(8, 2))
    assert not model.training and not model.module_shards[1].layers[0].training


# --- no plan: the plan is inferred from the model (tensorshard.plan_inference.infer) and self-checked -------------


def styles(model, plan) -> dict:
    """What a plan does to each module (patterns may differ: "w[13]" or "w1" and "w3")."""
    return {name: a.style for name, a in plan.assign(model).items()}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_feed_forward_without_a_plan(n, gen):
    torch.manual_seed(0)  # fixed weights: AdamW turns rounding in near-zero gradients into 1e-4 for rare inits
    ref = FeedForward(64, 176)
    model = split_copy(ref, n)
    if n > 1:
        assert styles(ref, model.plan) == styles(ref, plans.FEED_FORWARD)
    check_training_parity(ref, model, lambda: torch.randn(4, 7, 64, generator=gen))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_transformer_without_a_plan(n, gen):
    torch.manual_seed(0)
    ref = Transformer(dim=64, n_heads=8, n_kv_heads=2, hidden=176)
    model = split_copy(ref, n)
    check_training_parity(ref, model, lambda: torch.randint(0, 96, (2, 9), generator=gen))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_conv_net_without_a_plan(n, gen):
    torch.manual_seed(0)
    ref = ConvNet(channels=12)
    model = split_copy(ref, n)
    if n > 1:
        assert styles(ref, model.plan) == styles(ref, plans.CONV_NET)  # the classifier (12 -> 10) stays whole
    check_training_parity(ref, model, lambda: torch.randn(3, 3, 6, 6, generator=gen))


@pytest.mark.parametrize(
    "n_heads, n_kv_heads, dim, n",
    [(9, 9, 72, 2), (8, 2, 64, 4), (9, 3, 72, 2), (9, 3, 72, 4), (6, 6, 48, 4)],
)
def test_uneven_and_grouped_heads_without_a_plan(n_heads, n_kv_heads, dim, n, gen):
    torch.manual_seed(0)
    ref = Transformer(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, hidden=176)
    model = split_copy(ref, n)
    assert styles(ref, model.plan) == styles(ref, plans.transformer(n_heads, n_kv_heads))  # the hand plan, found
    check_training_parity(ref, model, lambda: torch.randint(0, 96, (2, 9), generator=gen))


class CountsCalls(nn.Module):
    """Updates an input in place, as recurrent models do with their state (RWKV)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, state):
        state.add_(1)
        return self.down(torch.relu(self.up(x))) * state


@pytest.mark.parametrize("n", [2, 3])
def test_inputs_updated_in_place_are_updated_once(n, gen):
    ref = CountsCalls()
    model = split_copy(ref, n, plan={"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()})
    x = torch.randn(4, 8, generator=gen)
    state, ref_state = torch.zeros(1), torch.zeros(1)
    for _ in range(3):
        out, want = model(x, state), ref(x, ref_state)
        assert torch.allclose(out, want, atol=1e-6)
    assert state.item() == ref_state.item() == 3  # the caller's tensor, advanced once per call
