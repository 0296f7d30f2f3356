"""The raw collectives (no autograd) of one rank of a torch.distributed process group: what the torchrun engine's
autograd nodes (comm/functions.py) and its setup code communicate with.

    all_reduce_copy(x, group)                          a new tensor: the sum (or max, ...) over the group
    gather_partition(x, dim, partition, group)         the whole tensor split by `partition`, on every rank
    gather_even / reduce_scatter_even                  sequence shards (.., T/N, ..) <-> whole (.., T, ..)
    RankCollectives(group, rank, world_size)           the same as a node's `Collectives` (comm/interface.py),
                                                       each reported once to comm/counter.py

The data travels through comm/transport.py (shared memory between the CPU processes of one host, else the process
group's backend), every call through its group's guard (comm/dist_guard.py), labelled with the operation and the
module ("all_reduce at layers.0.mlp.down_proj (backward)"), which is what an error names when a rank dies, raises or
does not arrive. All-gathers take equal sizes: uneven pieces (59/59/58 features, 5/4 heads) are padded to the
longest and trimmed after.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..partition import Partition
from .counter import record
from .interface import Collectives
from .transport import all_gather_, all_reduce_, reduce_scatter_


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def label(op: str, where: str = "", backward: bool = False) -> str:
    """How errors name a collective: 'all_reduce at w2 (backward)'."""
    return (f"{op} at {where}" if where else op) + (" (backward)" if backward else "")


def all_reduce_copy(x: torch.Tensor, group, op=dist.ReduceOp.SUM, *, what: str = "all_reduce") -> torch.Tensor:
    """A new tensor holding the reduction of `x` over `group` (x itself is left alone)."""
    out = x.detach().clone(memory_format=torch.contiguous_format)
    all_reduce_(out, group, op, what=what)
    return out


def gather_pieces(x: torch.Tensor, dim: int, sizes: list[int], group, *, what: str = "all_gather") -> list[torch.Tensor]:
    """Every rank's piece along `dim`; rank r's piece has sizes[r] entries (padded on the wire)."""
    longest = max(sizes)
    piece = x.detach()
    if piece.shape[dim] < longest:
        pad = list(piece.shape)
        pad[dim] = longest - piece.shape[dim]
        piece = torch.cat([piece, piece.new_zeros(pad)], dim)
    # Each rank's whole piece is one block of the output (no transposition of `dim` to the front, which
    # costs two strided copies of the full tensor when gathering logits along the vocabulary).
    piece = piece.contiguous()
    out = piece.new_empty((len(sizes) * piece.shape[0], *piece.shape[1:]))  # world pieces stacked on dim 0
    all_gather_(out, piece, group, what=what)
    blocks = out.view(len(sizes), *piece.shape)
    return [blocks[r].narrow(dim, 0, n) for r, n in enumerate(sizes)]


def gather_partition(x: torch.Tensor, dim: int, partition: Partition, group, *, what: str = "all_gather") -> torch.Tensor:
    """All-gather of a tensor split by `partition`: the whole tensor, on every rank."""
    sizes = [partition.local_size(r) for r in range(partition.world_size)]
    return partition.assemble(gather_pieces(x, dim, sizes, group, what=what), dim)


def check_even(x: torch.Tensor, dim: int, world: int, where: str) -> None:
    if x.shape[dim] % world:
        raise ValueError(
            f"{where or 'sequence parallelism'}: dimension {dim} of a {tuple(x.shape)} activation has length "
            f"{x.shape[dim]}, which does not split evenly over {world} devices. Sequence parallelism needs the "
            f"sequence length to be a multiple of the tensor-parallel size: pad the batch to a multiple of {world}."
        )


def gather_even(x: torch.Tensor, dim: int, world: int, group, *, what: str = "all_gather") -> torch.Tensor:
    """(.., T/N, ..) on each rank -> (.., T, ..), rank order."""
    front = x.detach().movedim(dim, 0).contiguous()
    out = front.new_empty((world * front.shape[0], *front.shape[1:]))
    all_gather_(out, front, group, what=what)
    return out.movedim(0, dim).contiguous()


def reduce_scatter_even(x: torch.Tensor, dim: int, world: int, group, *, what: str = "reduce_scatter") -> torch.Tensor:
    """(.., T, ..) partial sums on each rank -> this rank's (.., T/N, ..) slice of the total."""
    front = x.detach().movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    reduce_scatter_(out, front, group, what=what)
    return out.movedim(0, dim).contiguous()


class RankCollectives(Collectives):
    """This process's raw collectives over `group`, as the autograd nodes of comm/functions.py call them (one
    tensor: this rank's), each counted once."""

    def __init__(self, group, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.ranks = (rank,)

    @classmethod
    def of(cls, group) -> "RankCollectives":
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def reduce(self, xs, *, op, where, phase):
        x = xs[0]
        record("all_reduce", nbytes(x), phase, where)
        return [all_reduce_copy(x, self.group, what=label("all_reduce", where, phase == "backward"))]

    def gather(self, xs, dim, partition, *, op, where, phase):
        full = gather_partition(xs[0], dim, partition, self.group, what=label("all_gather", where, phase == "backward"))
        record("all_gather", nbytes(full), phase, where)
        return [full]

    def reduce_holders(self, xs, groups, *, where):
        """One all-reduce over the whole group of a (sharer groups, *shape) buffer: each rank writes its gradient
        into its group's row (no sub-groups to create, so every rank of every data-parallel replica makes the same
        calls)."""
        grad = xs[0]
        slot = next((i for i, ranks in enumerate(groups) if self.rank in ranks), None)
        buf = grad.new_zeros((len(groups), *grad.shape))
        if slot is not None:
            buf[slot] = grad
        all_reduce_(buf, self.group, what=label("all_reduce", where, backward=True))
        record("all_reduce", nbytes(buf), "backward", where)
        return [grad if slot is None else buf[slot]]

    def reduce_scatter_even(self, xs, dim, *, where, phase):
        what = label("reduce_scatter", where, phase == "backward")
        out = reduce_scatter_even(xs[0], dim, self.world_size, self.group, what=what)
        record("reduce_scatter", nbytes(out), phase, where)
        return [out]

    def gather_even(self, xs, dim, *, where, phase):
        full = gather_even(xs[0], dim, self.world_size, self.group, what=label("all_gather", where, phase == "backward"))
        record("all_gather", nbytes(full), phase, where)
        return [full]
