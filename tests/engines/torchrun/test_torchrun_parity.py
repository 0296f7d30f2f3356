"""Split under torchrun (gloo, 2 and 4 processes) and trained like the unsplit model.

Tolerances as in the in-process tests (fp32): forward within 1e-5 relative, after three AdamW steps within
1e-4. Every rank builds the same reference model (same seed) and checks its own replicated output.
"""

import copy

import pytest
import torch

import tensorshard as tp
from support import plans
from support.harness import world_mesh
from support.helpers import check_training_parity
from support.models import ConvNet, FeedForward, TinyEfficientNet, Transformer

pytestmark = pytest.mark.timeout(120)



def parity_task(kind: str, args: tuple) -> str:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    if kind == "feed_forward":
        ref, plan = FeedForward(*args), plans.FEED_FORWARD
        make_input = lambda: torch.randn(4, 7, args[0], generator=gen)  # noqa: E731
    elif kind == "transformer":
        dim, heads, kv_heads = args
        ref, plan = Transformer(dim=dim, n_heads=heads, n_kv_heads=kv_heads, hidden=176), plans.transformer(heads, kv_heads)
        make_input = lambda: torch.randint(0, 96, (2, 9), generator=gen)  # noqa: E731
    elif kind == "efficientnet":  # inferred: BatchNorm and depthwise convolutions split by channels
        ref = TinyEfficientNet()
        plan = tp.infer_plan(ref, torch.distributed.get_world_size())
        make_input = lambda: torch.randn(4, 8, 6, 6, generator=gen)  # noqa: E731
    else:
        ref, plan = ConvNet(channels=12), plans.CONV_NET
        make_input = lambda: torch.randn(3, 3, 6, 6, generator=gen)  # noqa: E731
    model = tp.parallelize(copy.deepcopy(ref), world_mesh(), plan=plan)
    check_training_parity(ref, model, make_input)
    return "ok"


@pytest.mark.parametrize("args", [(64, 176), (64, 90)])  # 90 over 4: 23/23/22/22, not torch.chunk's layout
def test_feed_forward(pool2, pool4, args):
    for pool in (pool2, pool4):
        assert pool.run(parity_task, "feed_forward", args) == ["ok"] * pool.world


@pytest.mark.parametrize("args", [(64, 8, 2), (48, 6, 6), (72, 9, 3)])  # 4 ranks: KV heads replicated; 6 heads: 2/2/1/1
def test_transformer(pool2, pool4, args):
    for pool in (pool2, pool4):
        assert pool.run(parity_task, "transformer", args) == ["ok"] * pool.world


def test_conv_net(pool2, pool4):
    for pool in (pool2, pool4):
        assert pool.run(parity_task, "conv", ()) == ["ok"] * pool.world


def test_efficientnet_block_trains_in_train_mode(pool2, pool3):
    for pool in (pool2, pool3):
        assert pool.run(parity_task, "efficientnet", ()) == ["ok"] * pool.world


class Logits(torch.nn.Module):
    """A causal LM's logits as a plain tensor output, for check_training_parity."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(ids).logits


def llama_task() -> str:
    from support import tiny_llama

    ref = tiny_llama.build()
    model = tp.parallelize(copy.deepcopy(ref), world_mesh(), plan=tiny_llama.plan())
    gen = torch.Generator().manual_seed(3)
    check_training_parity(Logits(ref), Logits(model), lambda: torch.randint(0, tiny_llama.VOCAB, (2, 9), generator=gen))
    return "ok"


def test_tiny_llama(pool2, pool4):  # 4 ranks: each of the 2 KV heads on two ranks
    for pool in (pool2, pool4):
        assert pool.run(llama_task) == ["ok"] * pool.world


def fused_adamw_task() -> list[tuple[float, float]]:
    """The preset Llama trained with labels= and `AdamW(fused=True)` (docs/torchrun.md: the fast CPU optimizer),
    split and unsplit: the fused kernel steps the engine's DTensor parameters."""
    from support import tiny_llama

    ref = tiny_llama.build()
    model = tp.parallelize(copy.deepcopy(ref), world_mesh())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, tiny_llama.VOCAB, (2, 9), generator=gen)
        pair = []
        for m, o in ((model, opt), (ref, ref_opt)):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            pair.append(loss.item())
        losses.append(tuple(pair))
    return losses


def test_fused_adamw_trains_like_unsplit(pool2):
    for split, single in pool2.run(fused_adamw_task)[0]:
        assert abs(split - single) <= 1e-4 * abs(single)  # fp32, the third loss after two AdamW steps
