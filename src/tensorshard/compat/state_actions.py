"""The `tensor_parallel` package's state actions (its module ``tensor_parallel.state_actions``).

    Split(world_size=2, dim=0)                                  # rows 0..k on device 0, the rest on 1
    SplitInChunks(world_size=2, dim=0, chunk_size=64)           # whole 64-row chunks (attention heads)
    SplitInGroupedChunks(world_size=2, dim=1, num_groups=3, chunk_size=64)   # q|k|v, each by heads
    Scale(world_size=2)                                         # divided by 2 (a row-split layer's bias)

The same constructors as the original's, so a config ports by changing its import. Calling an action on a
tensor returns rank `rank`'s piece and ``undo`` joins the pieces, as the original's do. The translator
reads them through `rules.read_action`; `LegacyStateAction` (a wrapped callable) exists so that code
building one still imports, but a callable has no tensorshard equivalent and is refused when translated.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["LegacyStateAction", "Scale", "Split", "SplitInChunks", "SplitInGroupedChunks", "StateAction"]


class StateAction:
    """Base class: what to do with one parameter or buffer on each device."""

    def __call__(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        raise NotImplementedError

    def undo(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


class LegacyStateAction(StateAction):
    """A callable ``f(tensor, rank)`` (and optionally its inverse), as the 1.x configs gave them."""

    def __init__(self, action: Callable[[torch.Tensor, int], torch.Tensor],
                 reverse_action: Callable[[Sequence[torch.Tensor]], torch.Tensor] | None = None) -> None:
        self.action, self.reverse_action = action, reverse_action

    def __call__(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        return self.action(tensor, rank)

    def undo(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if self.reverse_action is None:
            raise ValueError(f"{self!r} has no reverse action, so its pieces cannot be joined")
        return self.reverse_action(tensors)

    def __repr__(self) -> str:
        return f"LegacyStateAction({self.action!r})"


class Split(StateAction):
    """Cut `dim` into `world_size` contiguous pieces, the first ones one longer (``torch.tensor_split``)."""

    def __init__(self, world_size: int, dim: int) -> None:
        self.world_size, self.dim = world_size, dim

    def __call__(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        return _chunked(tensor, self.dim, 1, 1, self.world_size, rank)

    def undo(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.cpu() for t in tensors], self.dim)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size}, dim={self.dim})"


class SplitInChunks(Split):
    """Split `dim` on `chunk_size` boundaries: whole chunks (heads) per device."""

    def __init__(self, world_size: int, dim: int, chunk_size: int, optional: bool = False) -> None:
        super().__init__(world_size, dim)
        self.chunk_size, self.optional = chunk_size, optional

    def __call__(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        if tensor is None and self.optional:
            return None
        return _chunked(tensor, self.dim, 1, self.chunk_size, self.world_size, rank)

    def __repr__(self) -> str:
        return f"SplitInChunks(world_size={self.world_size}, dim={self.dim}, chunk_size={self.chunk_size})"


class SplitInGroupedChunks(Split):
    """`dim` holds `num_groups` equal blocks (q|k|v); each block is split on `chunk_size` boundaries and
    every device keeps its piece of every block, in block order."""

    def __init__(self, world_size: int, dim: int, num_groups: int, chunk_size: int) -> None:
        super().__init__(world_size, dim)
        self.num_groups, self.chunk_size = num_groups, chunk_size

    def __call__(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        return _chunked(tensor, self.dim, self.num_groups, self.chunk_size, self.world_size, rank)

    def undo(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        dim = tensor_dim(self.dim, tensors[0].dim())
        blocks = [t.cpu().unflatten(dim, (self.num_groups, -1)) for t in tensors]  # (.., groups, piece, ..)
        return torch.cat(blocks, dim + 1).flatten(dim, dim + 1)

    def __repr__(self) -> str:
        return (
            f"SplitInGroupedChunks(world_size={self.world_size}, dim={self.dim}, num_groups={self.num_groups}, "
            f"chunk_size={self.chunk_size})"
        )


class Scale(StateAction):
    """Divide by `world_size` on every device (so that a sum over devices counts the tensor once)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def __call__(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        return tensor / self.world_size

    def undo(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return tensors[0] * self.world_size

    def __repr__(self) -> str:
        return f"Scale(world_size={self.world_size})"


def tensor_dim(dim: int, ndim: int) -> int:
    """`dim` of a tensor with `ndim` dimensions, counted from 0; out of range, torch's IndexError (as the
    original's ``torch.tensor_split`` raised), not another dimension."""
    if not -ndim <= dim < ndim:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    return dim % ndim


def _chunked(tensor: torch.Tensor, dim: int, groups: int, chunk: int, world_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece: `dim` viewed as (groups, units, chunk), units cut by tensor_split."""
    dim = tensor_dim(dim, tensor.dim())
    grouped = tensor.unflatten(dim, (groups, -1, chunk))  # (.., groups, units, chunk, ..)
    return grouped.tensor_split(world_size, dim + 1)[rank].flatten(dim, dim + 2)
