"""Parity checks shared by the tests: a split model against the unsplit one it was copied from."""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

import tensorshard as tp


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def split_copy(ref: nn.Module, n: int, **kwargs) -> nn.Module:
    """tensor_parallel() over n CPU slots of a deep copy of `ref` (ref stays usable).

    ZeRO-3 stays off unless a test asks for it (sharded=True): these tests check the tensor-parallel layout
    and its collectives, which the default for train-mode models would extend by one all-gather per call.
    """
    kwargs.setdefault("sharded", False)
    return tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n, **kwargs)


def check_training_parity(
    ref: nn.Module,
    model: nn.Module,
    make_input: Callable[[], torch.Tensor],
    *,
    forward_tol: float = 1e-5,
    train_tol: float = 1e-4,
    steps: int = 3,
    lr: float = 1e-2,
    output: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda m, x: m(x),
) -> None:
    """Forward within forward_tol (relative, fp32); after `steps` AdamW steps on both, outputs on a fresh
    input within train_tol. `output` calls a model (default ``m(x)``)."""
    x = make_input()
    assert rel_err(output(model, x), output(ref, x)) < forward_tol
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr)
    for _ in range(steps):
        x = make_input()
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            output(m, x).float().square().mean().backward()
            o.step()
    x = make_input()
    with torch.no_grad():
        assert rel_err(output(model, x), output(ref, x)) < train_tol


def train_causal_lms(models, batches, *, lr: float = 1e-2) -> list[list[float]]:
    """AdamW over the trainable parameters of each model, one step per batch of token ids (the labels too),
    the models taking turns; each step's losses, in the models' order."""
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr) for m in models]
    losses = []
    for x in batches:
        row = []
        for m, opt in zip(models, optimizers):
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            row.append(loss.item())
        losses.append(row)
    return losses


def train_both_causal_lm(model: nn.Module, ref: nn.Module, batches, *, lr: float = 1e-2) -> list[tuple[float, float]]:
    """`train_causal_lms` of a split model and its unsplit reference: each step's losses as (split, unsplit)."""
    return [(split, unsplit) for split, unsplit in train_causal_lms((model, ref), batches, lr=lr)]


def log_messages(name: str, level: int) -> tuple[list[str], Callable[[], None]]:
    """The messages logger `name` emits at `level` and above from now on, and a function that stops collecting."""
    import logging

    messages: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.setLevel(level)
    return messages, lambda: logger.removeHandler(handler)
