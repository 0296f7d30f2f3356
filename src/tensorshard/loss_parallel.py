"""Cross-entropy on vocabulary-sharded logits, without ever gathering them.

    loss = tp.vocab_parallel_cross_entropy(logits, targets)   # logits: (..., V) DTensor, Shard(-1)

Each device holds logits z[..., a:b] for its vocabulary slice. With m = max over the whole vocabulary,

    loss = log(sum_v exp(z_v - m)) - (z_target - m)

needs three numbers per token from every device: its local max, its local sum of exp(z - m), and z_target
if the target falls in its slice (else 0). That is one all-reduce (max, no gradient) and one all-reduce of
a (2, tokens) tensor, against an all-gather of (tokens, V) logits. Backward needs no communication: each
device's gradient is softmax(z)[a:b] - onehot(target)[a:b] for its own slice, computed from the exp(z - m)
its forward kept (one autograd node: one (tokens, V / N) tensor made each way).

Plain (unsplit) logits are accepted too and go to `F.cross_entropy`, so the same training step runs on a
single device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Shard

from .comm import dist_ops, functions
from .comm.counter import record
from .comm.process_group import RankCollectives, all_reduce_copy


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
        logits.to_local(), target, rank * width, GroupReductions(logits.device_mesh.get_group()),
        vocab=logits.shape[-1], ignore_index=ignore_index, reduction=reduction,
    )


class GroupReductions:
    """The two reductions `sliced_cross_entropy` needs, over a torch.distributed process group (in one process,
    a shard's ThreadComm has the same two methods)."""

    def __init__(self, group) -> None:
        self.group = group
        self.group_name = group.group_name  # how a compiled graph names it (comm/dist_ops.py)
        self.raw = RankCollectives.of(group)

    def all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        if torch.compiler.is_compiling():
            return dist_ops.all_reduce(x, self.group_name, where)
        return functions.all_reduce(self.raw, where, x)[0]

    def all_reduce_max(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        if torch.compiler.is_compiling():
            return dist_ops.all_reduce_max(x.detach(), self.group_name, where)
        record("all_reduce", x.numel() * x.element_size(), "forward", where)
        return all_reduce_copy(x, self.group, op=dist.ReduceOp.MAX)


def sliced_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    start: int,
    reductions,
    *,
    vocab: int,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """`vocab_parallel_cross_entropy` on this device's plain slice of the logits: (..., V_local) holding classes
    start .. start + V_local of the `vocab` classes, the other slices on the other devices, which `reductions`
    (`GroupReductions` of a process group, or an in-process shard's ThreadComm) sums and maxes over."""

    bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    # (not while torch.compile traces: a branch on values breaks the graph; the eager call checks them)
    if not torch.compiler.is_compiling() and bad.any():  # F.cross_entropy refuses these; here no slice would hold them and the loss would be wrong
        raise ValueError(
            f"target holds class {int(target[bad][0])}, outside the vocabulary 0..{vocab - 1} (and not ignore_index="
            f"{ignore_index}): fix the labels, or mark the positions to skip with {ignore_index}"
        )

    t = target.flatten()
    loss = _SlicedCrossEntropy.apply(local_logits.flatten(0, -2).float(), t, start, reductions, ignore_index)
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (t != ignore_index).sum()


class _SlicedCrossEntropy(Function):
    """Per-token cross-entropy from this device's (tokens, V_local) slice `z` of the logits (0 for ignored
    tokens). One (tokens, V_local) tensor is made in forward, exp(z - max), and kept for backward, where the
    gradient, exp(z - max) / sum - onehot(target), is computed into one new tensor; no communication there."""

    @staticmethod
    def forward(ctx, z, t, start, reductions, ignore_index):
        # 1. the max over the whole vocabulary: a constant shift for stability
        shift = reductions.all_reduce_max(z.max(dim=-1).values, where="cross_entropy max").unsqueeze(-1)
        # 2. sum of exp and the target's shifted logit, each device contributing its vocabulary slice
        mine = (t >= start) & (t < start + z.shape[-1])
        local_t = (t - start).clamp(0, z.shape[-1] - 1).unsqueeze(1)
        picked = (z.gather(1, local_t) - shift).squeeze(1) * mine
        e = torch.sub(z, shift).exp_()
        sums = reductions.all_reduce(torch.stack([e.sum(-1), picked]), where="cross_entropy")  # (2, tokens)
        counted = t != ignore_index
        ctx.save_for_backward(e, sums[0], local_t, mine & counted, counted)
        return torch.where(counted, sums[0].log() - sums[1], torch.zeros_like(sums[1]))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        e, total, local_t, hit, counted = ctx.saved_tensors
        g = torch.where(counted, grad, torch.zeros_like(grad))
        dz = e * (g / total).unsqueeze(-1)
        dz.scatter_add_(1, local_t, -(g * hit).unsqueeze(1))
        return dz, None, None, None, None
