"""Which slice of one tensor dimension each device holds.

A dimension is cut into *units* that are never split: one feature of an MLP, one attention head of
`head_dim` features, the q|k|v triple of a head in an interleaved fused projection. Units are handed to
ranks in contiguous runs, as evenly as possible, larger runs first (176 features on 3 devices: 59, 59, 58;
9 heads on 2: 5, 4).

A dimension may concatenate several logical blocks (q|k|v, gate|up). Each block is split on its own and
every rank keeps its piece of every block, in the original block order, so the local tensor has the same
block structure as the full one, only smaller.

A balanced split (plans/balance.py) gives a layer's plain blocks chosen per-rank sizes instead of even ones
(`plain_sizes`: 1536 MLP features on 2 ranks as 688 + 848); every plain block of that length takes them.

Attention heads are assigned by `HeadGroups`, which keeps every query head on the rank that holds its
key/value head (grouped-query attention). With fewer KV heads than ranks, a KV head is replicated to each
rank whose query heads read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch

Range = tuple[int, int]


def split_evenly(n: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous runs covering `n` units, larger runs first: (176, 3) -> [59, 59, 58]."""
    base, extra = divmod(n, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def _runs(sizes: Sequence[int]) -> list[Range]:
    """[2, 3] -> [(0, 2), (2, 5)]."""
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class Partition:
    """The index ranges of one dimension (of length `size`) held by each rank, in local order.

    `ranges[r]` lists half-open `(start, stop)` ranges; rank r's local tensor is their concatenation.
    Ranges of different ranks are disjoint unless a unit is replicated (grouped KV heads on more ranks
    than KV heads), which `overlapping` reports.
    """

    size: int
    ranges: tuple[tuple[Range, ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.ranges)

    def local_size(self, rank: int) -> int:
        return sum(stop - start for start, stop in self.ranges[rank])

    @property
    def overlapping(self) -> bool:
        return sum(self.local_size(r) for r in range(self.world_size)) != self.size

    @property
    def is_trivial(self) -> bool:
        """True when every rank holds the whole dimension (one device, or a replicated unit)."""
        return all(rngs == ((0, self.size),) for rngs in self.ranges)

    def take(self, tensor: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Rank `rank`'s slice of `tensor` along `dim`, as a view when it is one contiguous range."""
        pieces = [tensor.narrow(dim, start, stop - start) for start, stop in self.ranges[rank]]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

    def assemble(self, pieces: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """Inverse of `take`: put each rank's local piece back at its place in a full-size tensor.

        All pieces must be on the same device. A replicated unit is taken from its first holder.
        """
        if not self.overlapping and all(len(r) == 1 for r in self.ranges):
            # The common case: rank order is index order, one contiguous run per rank.
            order = sorted(range(self.world_size), key=lambda r: self.ranges[r][0][0])
            return torch.cat([pieces[r] for r in order], dim)
        shape = list(pieces[0].shape)
        shape[dim] = self.size
        out = pieces[0].new_empty(shape)
        for rank in reversed(range(self.world_size)):  # reversed: the first holder writes last
            self.place(out, pieces[rank], dim, rank)
        return out

    def place(self, out: torch.Tensor, piece: torch.Tensor, dim: int, rank: int) -> None:
        """Copy rank `rank`'s local `piece` into its ranges of the full-size tensor `out`, in place."""
        offset = 0
        for start, stop in self.ranges[rank]:
            out.narrow(dim, start, stop - start).copy_(piece.narrow(dim, offset, stop - start))
            offset += stop - start

    @classmethod
    def replicated(cls, size: int, world_size: int) -> "Partition":
        return cls(size, tuple(((0, size),) for _ in range(world_size)))

    @classmethod
    def stacked(cls, rows: int, world_size: int) -> "Partition":
        """`world_size` blocks of `rows` each, in rank order: what an all-gather of equal pieces stacks."""
        return cls(rows * world_size, tuple(((r * rows, (r + 1) * rows),) for r in range(world_size)))


@dataclass(frozen=True)
class HeadGroups:
    """Assignment of attention heads to ranks, keeping grouped-query attention intact.

    `q[r]` and `kv[r]` are the (contiguous) query- and key/value-head ranges of rank r. Query head h reads
    KV head h // (num_heads // num_kv_heads) on every rank, so a rank's query heads always map onto its own
    KV heads with a uniform local group size.
    """

    num_heads: int
    num_kv_heads: int
    q: tuple[Range, ...]
    kv: tuple[Range, ...]

    @classmethod
    def build(cls, num_heads: int, num_kv_heads: int, world_size: int, *, where: str = "") -> "HeadGroups":
        at = f"{where}: " if where else ""
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(
                f"{at}{num_heads} query heads cannot be grouped over {num_kv_heads} key/value heads; "
                "num_heads must be a positive multiple of num_kv_heads."
            )
        group = num_heads // num_kv_heads
        if num_kv_heads >= world_size:
            # Whole KV groups per rank: 9 heads (MHA) on 2 ranks -> 5 + 4; 3 groups of 3 on 2 -> 6 + 3.
            kv = _runs(split_evenly(num_kv_heads, world_size))
            q = [(a * group, b * group) for a, b in kv]
        else:
            # Fewer KV heads than ranks: each KV head goes to a run of ranks, which split its query heads.
            ranks_per_kv = split_evenly(world_size, num_kv_heads)
            if group < max(ranks_per_kv):
                raise ValueError(
                    f"{at}{num_heads} query heads in {num_kv_heads} KV groups cannot be split over "
                    f"{world_size} devices: a KV group of {group} query heads would go to "
                    f"{max(ranks_per_kv)} devices, leaving one without a head. Use at most "
                    f"{num_heads} devices, or replicate this attention in the plan."
                )
            q, kv = [], []
            for head, n_ranks in enumerate(ranks_per_kv):
                for a, b in _runs(split_evenly(group, n_ranks)):
                    q.append((head * group + a, head * group + b))
                    kv.append((head, head + 1))
        return cls(num_heads, num_kv_heads, tuple(q), tuple(kv))

    @property
    def world_size(self) -> int:
        return len(self.q)

    @property
    def kv_replicated(self) -> bool:
        return self.num_kv_heads < self.world_size

    def local(self, rank: int) -> dict[str, int]:
        """Per-rank counts a forward pass reshapes with: heads, kv_heads and groups (heads per KV head)."""
        heads = self.q[rank][1] - self.q[rank][0]
        kv_heads = self.kv[rank][1] - self.kv[rank][0]
        return {"heads": heads, "kv_heads": kv_heads, "groups": heads // kv_heads}

    def kv_sharers(self) -> list[list[int]]:
        """Groups of ranks holding the same KV heads (only groups of two or more)."""
        by_range: dict[Range, list[int]] = {}
        for rank, rng in enumerate(self.kv):
            by_range.setdefault(rng, []).append(rank)
        return [ranks for ranks in by_range.values() if len(ranks) > 1]


_BLOCK = re.compile(r"^(q|kv)(?:\*(\d+))?$")

Block = "int | str"  # an int size (split by single features) or "q", "kv", "q*3", "kv*5" (head units)


def parse_block(block: int | str) -> tuple[str, int]:
    """"q" -> ("q", 1); "kv*5" -> ("kv", 5); 1024 -> ("plain", 1024)."""
    if isinstance(block, bool) or not isinstance(block, (int, str)):
        raise TypeError(f"a block is an int size or one of 'q', 'kv', 'q*N', 'kv*N'; got {block!r}")
    if isinstance(block, int):
        if block < 1:
            raise ValueError(f"a block size must be positive; got {block}")
        return "plain", block
    match = _BLOCK.match(block.strip())
    if not match:
        raise ValueError(
            f"unknown block {block!r}: use an int size, 'q' (query heads), 'kv' (key/value heads), "
            "or 'q*N' / 'kv*N' for N head-sized pieces per head (interleaved fused projections)"
        )
    return match.group(1), int(match.group(2) or 1)


def block_partition(
    size: int,
    world_size: int,
    blocks: Sequence[int | str] | None = None,
    heads: HeadGroups | None = None,
    *,
    where: str = "",
    plain_sizes: Sequence[int] | None = None,
) -> Partition:
    """Partition a dimension of `size` made of `blocks` (None: one plain block) over `world_size` ranks.

    Head blocks need `heads`; the head size is what is left of `size` after the plain blocks, divided by
    the number of head units: for blocks ("q", "kv", "kv") of a GPT-2 c_attn, size / (H + 2K).
    `plain_sizes`: per-rank unit counts for every plain block of ``sum(plain_sizes)`` features (a balanced
    split, plans/balance.py); other plain blocks split evenly.
    """
    at = f"{where}: " if where else ""
    parsed = [parse_block(b) for b in (blocks if blocks else (size,))]
    head_units = 0
    plain = 0
    for kind, n in parsed:
        if kind == "plain":
            plain += n
        else:
            if heads is None:
                raise ValueError(
                    f"{at}blocks {list(blocks or [])} name attention heads, but no Heads(...) entry in the "
                    "plan matches a parent module; add one for the attention module"
                )
            head_units += n * (heads.num_heads if kind == "q" else heads.num_kv_heads)
    if head_units:
        if (size - plain) <= 0 or (size - plain) % head_units:
            raise ValueError(
                f"{at}{size} features do not divide into blocks {list(blocks or [])} with "
                f"{heads.num_heads} heads / {heads.num_kv_heads} KV heads ({head_units} head units). Check the "
                "Heads entry's num_heads / num_kv_heads against the model, and this layer's blocks."
            )
        head_dim = (size - plain) // head_units
    elif plain != size:
        raise ValueError(
            f"{at}blocks {list(blocks or [])} add up to {plain}, but the dimension has {size}; give block sizes "
            f"that add up to {size} (e.g. ({size // 2}, {size - size // 2}) for two fused halves), or no blocks"
        )

    per_rank: list[list[Range]] = [[] for _ in range(world_size)]
    pieces_per_rank = _block_pieces(parsed, world_size, heads, head_dim if head_units else 0, at, plain_sizes)
    for rank, pieces in enumerate(pieces_per_rank):
        per_rank[rank] = [(start, stop) for start, stop, _ in pieces]
    return Partition(size, tuple(tuple(_merge(r)) for r in per_rank))


def kv_local_ranges(
    size: int,
    world_size: int,
    blocks: Sequence[int | str],
    heads: HeadGroups,
    rank: int,
    plain_sizes: Sequence[int] | None = None,
) -> list[Range]:
    """Where the KV-head pieces sit inside rank `rank`'s local tensor (for tying replicated KV heads)."""
    partition = block_partition(size, world_size, blocks, heads, plain_sizes=plain_sizes)  # validates
    parsed = [parse_block(b) for b in blocks]
    head_units = sum(n * (heads.num_heads if k == "q" else heads.num_kv_heads) for k, n in parsed if k != "plain")
    plain = sum(n for k, n in parsed if k == "plain")
    head_dim = (partition.size - plain) // head_units
    out, offset = [], 0
    for start, stop, kind in _block_pieces(parsed, world_size, heads, head_dim, "", plain_sizes)[rank]:
        if kind == "kv":
            out.append((offset, offset + stop - start))
        offset += stop - start
    return _merge(out)


def _block_pieces(parsed, world_size, heads, head_dim, at, plain_sizes=None) -> list[list[tuple[int, int, str]]]:
    """Per rank, the (start, stop, kind) pieces it holds, block by block, in the original order."""
    per_rank: list[list[tuple[int, int, str]]] = [[] for _ in range(world_size)]
    offset = 0
    for kind, n in parsed:
        if kind == "plain":
            if n < world_size:
                raise ValueError(
                    f"{at}a block of {n} features cannot be split over {world_size} devices; "
                    f"use at most {n} devices or replicate this layer"
                )
            given = plain_sizes is not None and sum(plain_sizes) == n
            if given and (len(plain_sizes) != world_size or min(plain_sizes) < 1):
                raise ValueError(f"{at}plain_sizes {list(plain_sizes)} must give each of {world_size} devices a unit or more")
            unit, rank_units = 1, _runs(plain_sizes if given else split_evenly(n, world_size))
            length = n
        else:
            unit = n * head_dim
            rank_units = list(heads.q if kind == "q" else heads.kv)
            length = unit * (heads.num_heads if kind == "q" else heads.num_kv_heads)
        for rank, (a, b) in enumerate(rank_units):
            per_rank[rank].append((offset + a * unit, offset + b * unit, kind))
        offset += length
    return per_rank


def _merge(ranges: list[Range]) -> list[Range]:
    """Join touching ranges: [(0, 4), (4, 8)] -> [(0, 8)]."""
    out: list[Range] = []
    for start, stop in ranges:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        else:
            out.append((start, stop))
    return out
