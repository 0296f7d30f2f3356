"""Reshapes that name a fixed head count: `q.view(B, T, self.n_heads, head_dim)` on split features.

A column-parallel layer that leaves its output split hands each device its own heads' features: 32 of 64 on
2 devices. Model code that reshapes them into heads with the model's global head count (an attribute read at
call time, a literal) asks each device for all 4 heads of 16 and fails at the first call with torch's own
`shape '[2, 8, 4, 16]' is invalid for input of size 512`, from the user's code. Written with `-1` (or with a
count a `tp.Heads` entry gives each device: its `attrs`), the same reshape is right on every device.

The traced pass (tracer.py) runs the unsplit model, where both spellings give the same shape; what tells them
apart is the shape as the code passed it: a `-1` where the heads go, or a number. `note` records, for each
`view` / `reshape` of a tensor carrying split features, an explicit count (not -1) that divides the features
into heads (the new last two sizes multiply to the old last one); plancheck.py refuses a plan whose split
features meet one, unless a Heads entry covers the module where it happens (its count is then per device).

A count the code computed from a tensor's own size (`q.view(B, T, q.size(-1) // head_dim, head_dim)`, or
`B, T, C = q.size()` then `C // head_dim`) is right on every device too, when that tensor carries split features:
each device then divides its own features. So the traced pass hands out the last size of a tensor carrying features
as a `FeatureSize` (an int that remembers those features, and keeps them through `//`); a reshape whose count is one
is noted with them, and plancheck.py accepts it when they are split like the reshaped ones. A count computed from a
whole tensor's size (the attention's input: `x.size(-1) // head_dim`) is the model's whole head count: refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .features import Ids

_RESHAPES = ("view", "reshape")


@dataclass
class FixedCount:
    """One reshape of split features into heads by an explicit count."""

    ids: Ids  # the input's shadow (the features it carries)
    where: str  # the module it happened in
    shape: tuple  # the shape as the code passed it
    count: int  # the explicit head count
    head_dim: int
    count_ids: Ids | None = None  # the count computed from the size of a tensor carrying these features (FeatureSize)


class FeatureSize(int):
    """The last size of a traced tensor carrying features (`ids`, its shadow): an int that keeps them through `//`."""

    ids: Ids

    def __new__(cls, value: int, ids: Ids) -> "FeatureSize":
        made = super().__new__(cls, value)
        made.ids = ids
        return made

    def __floordiv__(self, other):
        out = int(self) // other
        return FeatureSize(out, self.ids) if isinstance(out, int) else out


def sizes(out, x: torch.Tensor, ids: Ids, args: tuple):
    """`x.size(...)` or `x.shape` (`out`) with the last size as a FeatureSize (x carries the features `ids`)."""
    last = x.dim() - 1
    if x.dim() == 0:
        return out
    if isinstance(out, int):  # x.size(dim)
        dim = args[1] if len(args) > 1 else None
        return FeatureSize(out, ids) if isinstance(dim, int) and dim % x.dim() == last else out
    if isinstance(out, torch.Size):
        return torch.Size((*out[:last], FeatureSize(out[last], ids)))
    return out


def note(name: str, args: tuple, out, ids: Ids, where: str, found: list[FixedCount]) -> None:
    """Record a reshape of `args[0]` (carrying split features, `ids`) into heads by an explicit count."""
    if name not in _RESHAPES or len(args) < 2 or not isinstance(args[0], torch.Tensor):
        return
    x = args[0]
    shape = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
    if not isinstance(out, torch.Tensor) or x.dim() < 1 or out.dim() != x.dim() + 1 or len(shape) != out.dim():
        return
    if any(isinstance(s, torch.dtype) for s in shape) or tuple(out.shape[:x.dim() - 1]) != tuple(x.shape[:-1]):
        return
    count, head_dim = shape[-2], out.shape[-1]
    if isinstance(count, int) and count > 1 and count * head_dim == x.shape[-1]:
        shown = tuple(int(s) if isinstance(s, int) else s for s in shape)
        found.append(FixedCount(ids, where, shown, int(count), head_dim, getattr(count, "ids", None)))
