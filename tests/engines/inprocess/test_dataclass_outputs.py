"""A forward that returns a plain ``@dataclass`` (not a dict, tuple or transformers ModelOutput): its tensors are
outputs like any other (tensorshard/trees.py). Plan inference keeps what reaches them whole, the split model
gathers them with their gradients, and the caller gets an object of the same class (frozen ones too)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorshard as tp
from support.helpers import rel_err
from support.hf_parity import gathered_grads

pytestmark = pytest.mark.timeout(120)


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "kept"


@dataclasses.dataclass(frozen=True)
class FrozenOut:
    logits: torch.Tensor


class Net(nn.Module):
    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.frozen = frozen
        self.proj, self.fc1, self.fc2, self.cls = nn.Linear(32, 64), nn.Linear(64, 256), nn.Linear(256, 64), nn.Linear(64, 11)

    def forward(self, features):
        h = self.proj(features)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        logits = self.cls(h.mean(1))
        return FrozenOut(logits) if self.frozen else Out(logits, h)


@pytest.mark.parametrize("n", [2, 3])
def test_a_dataclass_output_is_the_unsplit_models(n):
    torch.manual_seed(0)
    ref = Net()
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n)
    x = torch.randn(2, 6, 32)
    got, want = model(x), ref(x)
    assert type(got) is Out and got.note == "kept"
    assert got.hidden.shape == want.hidden.shape  # before: device 0's slice of the hidden states
    assert rel_err(got.hidden, want.hidden) < 1e-5 and rel_err(got.logits, want.logits) < 1e-5
    (got.logits.sum() + got.hidden.pow(2).mean()).backward()
    (want.logits.sum() + want.hidden.pow(2).mean()).backward()
    grads = gathered_grads(model)
    for name, p in ref.named_parameters():  # before: relative error 1.0 for fc1 and fc2
        assert rel_err(grads[name], p.grad) < 1e-5, name


@pytest.mark.parametrize("n", [2, 3])
def test_training_through_a_dataclass_output_matches_the_unsplit_model(n):
    torch.manual_seed(0)
    ref = Net(frozen=True)
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n, plan={"fc1": tp.ColwiseParallel(), "fc2": tp.RowwiseParallel()})
    x = torch.randn(2, 6, 32)
    losses = []
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        run = []
        for _ in range(3):
            out = m(x)
            assert type(out) is FrozenOut
            loss = out.logits.pow(2).mean()
            loss.backward()  # before: the split model's gradients were not the unsplit model's (rel. error 1.0)
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses.append(run)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
