"""The optimizer families of the whole-weight tests (tensorshard/optimizers), built the way people use them, and
a training loop that reports each step's loss; shared by the in-process and torchrun tests.

- "muon": torch.optim.Muon on the blocks' 2-D weights, AdamW on the rest (embeddings, head, norms);
- "adafactor": torch.optim.Adafactor on everything (factored moments of matrices, the RMS of every tensor);
- "lamb": bitsandbytes' LAMB (a per-tensor trust ratio): refused;
- "muon_subclass": a Muon subclass overriding step(): refused;
- "unknown_subclass": an SGD subclass overriding step() (elementwise, but nothing says so): one warning.
"""

from __future__ import annotations

import torch
from torch import nn

MUON_LR = 1e-3  # Muon's default. Its Newton-Schulz iteration runs in bfloat16: a gradient that differs in the
# last fp32 bits (the split model reduces in another order) can round differently there, and a larger lr
# carries that further (at 2e-2, 8 steps: 5e-5 relative in the loss; at 1e-3: 2e-6).


class LoggingMuon(torch.optim.Muon):
    def step(self, closure=None):
        self.steps = getattr(self, "steps", 0) + 1
        return super().step(closure)


class CountingSGD(torch.optim.SGD):
    def step(self, closure=None):
        self.steps = getattr(self, "steps", 0) + 1
        return super().step(closure)


def _is_matrix(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and "embed" not in name and "lm_head" not in name


def build(model: nn.Module, family: str) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    matrices = [p for n, p in named if _is_matrix(n, p)]
    rest = [p for n, p in named if not _is_matrix(n, p)]
    if family in ("muon", "muon_subclass"):
        muon = LoggingMuon if family == "muon_subclass" else torch.optim.Muon
        return [muon(matrices, lr=MUON_LR), torch.optim.AdamW(rest, lr=1e-3)]
    if family == "adafactor":
        return [torch.optim.Adafactor(model.parameters(), lr=1e-2)]
    if family == "lamb":
        import bitsandbytes as bnb

        return [bnb.optim.LAMB(model.parameters(), lr=1e-3)]
    if family == "unknown_subclass":
        return [CountingSGD(model.parameters(), lr=0.1, momentum=0.9)]
    raise ValueError(family)


def single(model: nn.Module, family: str) -> torch.optim.Optimizer:
    """One optimizer for a checkpoint: Adafactor over everything, or Muon over the blocks' matrices (the rest
    frozen)."""
    if family == "adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=1e-2)
    for name, p in model.named_parameters():
        p.requires_grad_(_is_matrix(name, p))
    return torch.optim.Muon([p for p in model.parameters() if p.requires_grad], lr=MUON_LR)


def batches(steps: int, batch: int = 2, seq: int = 12, vocab: int = 128) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(steps)]


def train(model: nn.Module, optimizers: list[torch.optim.Optimizer], data: list[torch.Tensor], *,
          closure: bool = False) -> list[float]:
    """One step per batch (labels = inputs); each step's loss. With `closure`, the first optimizer's step gets
    a closure that computes loss and gradients (as Lightning steps), counted in `train.closure_calls`."""
    losses = []
    train.closure_calls = 0
    for x in data:
        def compute(x=x):
            train.closure_calls += 1
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            return loss

        loss = optimizers[0].step(compute) if closure else compute()
        for opt in optimizers[bool(closure):]:
            opt.step()
        for opt in optimizers:
            opt.zero_grad()
        losses.append(loss.item())
    return losses


def worst_rel(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter's local values (a DTensor's local slice), copied."""
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]


def unchanged(model: nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(snapshot(model), before))
