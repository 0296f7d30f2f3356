"""The `tensor_parallel` package's state actions, and what each one means to the translator.

    Split(world_size=2, dim=0)                                  # rows 0..k on device 0, the rest on 1
    SplitInChunks(world_size=2, dim=0, chunk_size=64)           # whole 64-row chunks (attention heads)
    SplitInGroupedChunks(world_size=2, dim=1, num_groups=3, chunk_size=64)   # q|k|v, each by heads
    Scale(world_size=2)                                         # divided by 2 (a row-split layer's bias)

The same constructors as the original's, so a config ports by changing its import. The 1.x strings
``"split 0"``, ``"split 1"`` and ``"scale"`` mean the same as Split / Scale. Calling an action on a
tensor returns rank `rank`'s piece, as the original does; the translator (translate.py) only reads them
through `read_action`, which turns each into a `Rule`: which dim, in units of how many features, in how
many groups. Anything else (a callable, a `LegacyStateAction`, a subclass that overrides how it splits)
has no tensorshard equivalent and is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


class StateAction:
    """Base class: what to do with one parameter or buffer on each device."""

    def __call__(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        raise NotImplementedError

    def undo(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


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
        dim = self.dim % tensors[0].dim()
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


def _chunked(tensor: torch.Tensor, dim: int, groups: int, chunk: int, world_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece: `dim` viewed as (groups, units, chunk), units cut by tensor_split."""
    dim = dim % tensor.dim()
    grouped = tensor.unflatten(dim, (groups, -1, chunk))  # (.., groups, units, chunk, ..)
    return grouped.tensor_split(world_size, dim + 1)[rank].flatten(dim, dim + 2)


# --- what the translator reads ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """A state rule, normalised: ``split`` along `dim` in units of `chunk` features, in `groups` equal
    blocks; or ``scale``. `text` is how the user wrote it, for messages."""

    kind: str  # "split" | "scale"
    text: str
    dim: int = 0
    chunk: int = 1
    groups: int = 1

    def action(self, world_size: int) -> StateAction:
        if self.kind == "scale":
            return Scale(world_size)
        return SplitInGroupedChunks(world_size, self.dim, self.groups, self.chunk)


_KNOWN = {"Split": Split, "SplitInChunks": SplitInChunks, "SplitInGroupedChunks": SplitInGroupedChunks, "Scale": Scale}


def read_action(action: Any, world_size: int) -> Rule | str:
    """The `Rule` an action stands for, or a sentence saying why it has no tensorshard equivalent.

    The original package's own objects (``tensor_parallel.state_actions.Split`` ...) are read by class
    name and attributes, like ours; subclasses are not, since they may split differently.
    """
    if isinstance(action, str):
        kind, *opts = action.split()
        if kind == "split" and len(opts) == 1 and opts[0].lstrip("-").isdigit():
            return Rule("split", repr(action), dim=int(opts[0]))
        if kind == "scale" and not opts:
            return Rule("scale", repr(action))
        return f"{action!r} is not a state rule (use 'split <dim>', 'scale', Split, SplitInChunks, SplitInGroupedChunks or Scale)"
    name = type(action).__name__
    if name not in _KNOWN or (isinstance(action, StateAction) and type(action) is not _KNOWN[name]):
        what = "a Python callable" if callable(action) else f"a {name}"
        return (
            f"{action!r} is {what}; tensorshard.compat translates only Split, SplitInChunks, SplitInGroupedChunks, "
            "Scale and the strings 'split <dim>' / 'scale'. Write this part as a tensorshard Plan "
            "(docs/plans.md: ColwiseParallel(blocks=...), ShardParams)"
        )
    given = getattr(action, "world_size", None)
    if given != world_size:
        return f"{action!r} was made for world_size={given}, but the model is being split over {world_size} devices"
    if name == "Scale":
        return Rule("scale", repr(action))
    chunk, groups = getattr(action, "chunk_size", 1), getattr(action, "num_groups", 1)
    if not all(isinstance(v, int) and v >= 1 for v in (chunk, groups)):
        return f"{action!r}: chunk_size and num_groups must be positive ints"
    return Rule("split", repr(action), dim=action.dim, chunk=chunk, groups=groups)
