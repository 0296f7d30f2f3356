"""Cross-entropy on vocabulary-sharded logits, without ever gathering them.

    loss = tp.vocab_parallel_cross_entropy(logits, targets)   # logits: (..., V) DTensor, Shard(-1)

Each device holds logits z[..., a:b] for its vocabulary slice. With m = max over the whole vocabulary,

    loss = log(sum_v exp(z_v - m)) - (z_target - m)

needs three numbers per token from every device: its local max, its local sum of exp(z - m), and z_target
if the target falls in its slice (else 0). That is one all-reduce (max, no gradient) and one all-reduce of
a (2, tokens) tensor, against an all-gather of (tokens, V) logits. Backward needs no communication: the
all-reduce's backward is the identity (comm/base.py), and each device's gradient is
softmax(z)[a:b] - onehot(target)[a:b] for its own slice.

Plain (unsplit) logits are accepted too and go to `F.cross_entropy`, so the same training step runs on a
single device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from .comm.counter import record
from .comm.dist import all_reduce, all_reduce_copy


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of (..., V) logits against (...) class indices, as `F.cross_entropy` computes it.

    Args:
        logits: a DTensor sharded on its last dimension over a 1-D mesh (the output of
            `VocabParallelHead`), or a plain tensor.
        target: class indices, shaped like `logits` without its last dimension; `ignore_index` entries
            do not count.
        reduction: ``"mean"`` (over counted targets), ``"sum"`` or ``"none"``.
    """

    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: use 'mean', 'sum' or 'none'")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target has shape {tuple(target.shape)} but logits {tuple(logits.shape)}: target must be the logits' "
            "shape without the vocabulary dimension (shift labels before calling, as for F.cross_entropy)"
        )
    if not isinstance(logits, DTensor):
        flat = F.cross_entropy(logits.flatten(0, -2).float(), target.flatten(), ignore_index=ignore_index, reduction=reduction)
        return flat.view(target.shape) if reduction == "none" else flat
    last = logits.dim() - 1
    if logits.device_mesh.ndim != 1 or tuple(logits.placements) != (Shard(last),):
        raise ValueError(
            f"vocab_parallel_cross_entropy needs logits sharded on their last dimension over a 1-D mesh; got "
            f"placements {tuple(logits.placements)} on a {logits.device_mesh.ndim}-D mesh (use VocabParallelHead)"
        )
    rank, world = logits.device_mesh.get_local_rank(), logits.device_mesh.size()
    width = -(-logits.shape[-1] // world)  # torch.chunk's slice length
    return sliced_cross_entropy(
        logits.to_local(), target, rank * width, logits.device_mesh.get_group(), vocab=logits.shape[-1],
        ignore_index=ignore_index, reduction=reduction,
    )


class _GroupReductions:
    """The two reductions the loss needs, over a torch.distributed process group."""

    def __init__(self, group) -> None:
        self.group = group

    def all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        return all_reduce(x, self.group, where=where)

    def all_reduce_max(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        record("all_reduce", x.numel() * x.element_size(), "forward", where)
        return all_reduce_copy(x, self.group, op=dist.ReduceOp.MAX)


def sliced_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    start: int,
    group,
    *,
    vocab: int,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """`vocab_parallel_cross_entropy` on this rank's plain slice of the logits: (..., V_local) holding classes
    start .. start + V_local of the `vocab` classes, the other slices on the other ranks of `group` (a process
    group, or an in-process shard's ThreadComm: anything with `all_reduce` and `all_reduce_max`)."""

    bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    if bad.any():  # F.cross_entropy refuses these; here no slice would hold them and the loss would be wrong
        raise ValueError(
            f"target holds class {int(target[bad][0])}, outside the vocabulary 0..{vocab - 1} (and not ignore_index="
            f"{ignore_index}): fix the labels, or mark the positions to skip with {ignore_index}"
        )

    z = local_logits.flatten(0, -2).float()  # (tokens, V / N)
    t = target.flatten()
    # 1. the max over the whole vocabulary: a constant shift for stability, no gradient
    reductions = group if hasattr(group, "all_reduce_max") else _GroupReductions(group)
    local_max = z.detach().max(dim=-1).values
    shift = reductions.all_reduce_max(local_max, where="cross_entropy max")
    z = z - shift.unsqueeze(-1)
    # 2. sum of exp and the target's logit, each device contributing its vocabulary slice
    mine = (t >= start) & (t < start + z.shape[-1])
    picked = z.gather(1, (t - start).clamp(0, z.shape[-1] - 1).unsqueeze(1)).squeeze(1) * mine
    sums = reductions.all_reduce(torch.stack([z.exp().sum(-1), picked]), where="cross_entropy")  # (2, tokens)
    loss = sums[0].log() - sums[1]
    counted = t != ignore_index
    loss = torch.where(counted, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / counted.sum()
