"""The gradient norm of a split model, every element of the unsplit model counted once.

`torch.nn.utils.clip_grad_norm_(split.parameters(), ...)` sums over every tensor the shards hold. Where a
tensor is held more than once, that over-counts it: a parameter left whole on every device (``sharded=False``,
or too small for ZeRO-3), and the rows of a grouped KV head repeated on several devices (more devices than KV
heads). `clip_grad_norm_` here counts each element once, at its first holder, and scales every copy by the
same factor, so clipping matches the unsplit model's:

    loss.backward()
    split.clip_grad_norm_(1.0)          # the unsplit model's norm, before clipping
    optimizer.step()
"""

from __future__ import annotations

import torch
from torch import nn

from ...partition import Partition


def owned_ranges(part: Partition, rank: int) -> list[tuple[int, int]]:
    """Local (start, stop) index ranges of rank `rank`'s tensor that no lower rank holds."""
    taken = sorted(rng for r in range(rank) for rng in part.ranges[r])
    owned, offset = [], 0
    for start, stop in part.ranges[rank]:
        pos = start  # everything of this range before pos is accounted for
        for a, b in taken:
            if b <= pos or a >= stop:
                continue
            if a > pos:
                owned.append((offset + pos - start, offset + a - start))
            pos = max(pos, min(b, stop))
        if pos < stop:
            owned.append((offset + pos - start, offset + stop - start))
        offset += stop - start
    return owned


def _counted(model: nn.Module, name: str, rank: int, grad: torch.Tensor) -> list[torch.Tensor]:
    """The pieces of shard `rank`'s gradient of `name` that count towards the norm."""
    zero = getattr(model, "zero_splits", None) or {}
    if name in zero:
        return [grad]  # ZeRO-3: every device holds its own rows
    split = model.splits.get(name)
    if split is None:
        return [grad] if rank == 0 else []  # whole on every device: once
    dim, part = split
    if not part.overlapping:
        return [grad]
    return [grad.narrow(dim, a, b - a) for a, b in owned_ranges(part, rank)]


def grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The total `norm_type` norm of the split model's gradients, as the unsplit model's (on the output device)."""
    norm_type = float(norm_type)
    partial = []
    for rank, shard in enumerate(model.module_shards):
        for name, p in shard.named_parameters():
            if p.grad is None:
                continue
            for piece in _counted(model, name, rank, p.grad.detach()):
                if piece.numel() == 0:
                    continue
                if norm_type == float("inf"):
                    partial.append(piece.abs().max().to(model.output_device))
                else:
                    partial.append(torch.linalg.vector_norm(piece, norm_type).pow(norm_type).to(model.output_device))
    if not partial:
        return torch.tensor(0.0, device=model.output_device)
    total = torch.stack(partial)
    return total.max() if norm_type == float("inf") else total.sum().pow(1.0 / norm_type)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scales every shard's gradients so the unsplit model's gradient norm is at most `max_norm`, as
    `torch.nn.utils.clip_grad_norm_` does to an unsplit model; returns the norm before clipping."""
    total = grad_norm(model, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the split model's gradients is non-finite ({total.item()}); "
            "pass error_if_nonfinite=False to clip anyway"
        )
    factor = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for shard in model.module_shards:
            grads = [p.grad for p in shard.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor.to(grads[0].device))
    return total
