"""Silently wrong, class 1: splitting must not change any submodule's train/eval mode (docs/errors.md)."""

import copy

import pytest
import torch
from torch import nn

import tensorshard as tp
from support.helpers import rel_err

pytestmark = pytest.mark.timeout(60)


class Wrapper(nn.Module):
    """A train-mode wrapper around an eval-mode model: what peft's get_peft_model returns."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(
            nn.Linear(8, 32), nn.Dropout(0.5), nn.GELU(), nn.Linear(32, 32), nn.Dropout(0.5), nn.GELU(), nn.Linear(32, 8)
        )

    def forward(self, x):
        return self.inner(x)


def mixed_modes() -> Wrapper:
    torch.manual_seed(0)
    model = Wrapper()
    model.train()
    model.inner.eval()  # the dropout inside is off, the wrapper says "training"
    return model


def modes(module: nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in module.named_modules()}


@pytest.mark.parametrize("sharded", [False, True])
def test_each_submodule_keeps_its_own_mode(gen, sharded):
    ref = mixed_modes()
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, sharded=sharded)
    assert split.training
    for shard in split.module_shards:
        assert modes(shard) == modes(ref)
    x = torch.randn(4, 8, generator=gen)
    # Dropout stays off inside: the unsplit model's numbers (before the fix, off by ~0.8 relative).
    assert rel_err(split(x), ref(x)) < 1e-5


def test_train_and_eval_after_splitting_reach_every_shard():
    split = tp.tensor_parallel(mixed_modes(), ["cpu"] * 2, sharded=False)
    split.train()
    assert all(m.training for shard in split.module_shards for m in shard.modules())
    split.eval()
    assert not any(m.training for m in split.modules())
