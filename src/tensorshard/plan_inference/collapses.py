"""Columns whose features all fall into one unit during a trace: a single key/value head, or nothing to split.

When an op joins every output feature of a column into one class (a LayerNorm over a Linear's output, a
softmax over its features, RoPE over the only key head of multi-query attention), the column has a single
unit. Usually that means it cannot be split, and its features must stop being followed at once: a layer
that read them would look like a row of that column, and the layers after it would never be column
candidates.

One single unit is meant to be whole on every device, though: the one key/value head of multi-query
attention (Gemma3-1B, Falcon-7B: ``num_key_value_heads=1``), which every query head *needs* (features.py)
and which `HeadGroups` replicates, exactly like a KV head shared by several devices when KV heads are fewer
than devices. Telling the two apart takes the attention product, which comes after RoPE or a per-head
norm. So a collapse is *pending* while the module that holds the column is still running (its
self-attention): its features are followed, and

- if a layer (or a channel-wise module) reads them first, or the module returns and no other unit needs
  them, the collapse *fails*: the features are poisoned with the reason and every tensor carrying them
  loses its shadow, as if they had been dropped when they collapsed;
- if the module returns and query units need them, they are one replicated key/value unit and stay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .features import FeatureSet, Ids, compact


class TraceState(Protocol):
    """What a collapse reads and changes of the trace it belongs to (tracer.py's Tracer; described here rather
    than imported, as the Tracer imports this file)."""

    fs: FeatureSet  # the feature classes
    stack: list[str]  # the modules in progress, outermost first

    def shadow(self, t: torch.Tensor) -> Ids | None: ...
    def set_shadow(self, t: torch.Tensor, ids: Ids | None) -> None: ...
    def poison(self, ids: Ids, reason: str, kind: str = "op", where: str | None = None) -> None: ...
    def where(self) -> str: ...


@dataclass(eq=False)
class Collapse:
    """One column whose features fell into a single class, and the tensors that carry that class since."""

    root: int  # the class (at the time of the collapse; classes may merge later: compare with find)
    ids: Ids  # the distinct feature ids of the tensor that collapsed, for the poison
    reason: str
    where: str
    depth: int  # position on the module stack of the innermost module in progress holding the column
    tensors: list[torch.Tensor] = field(default_factory=list)


class Collapses:
    """The pending collapses of one trace (see the module docstring)."""

    def __init__(self, tracer: TraceState) -> None:
        self.tr = tracer
        self.pending: list[Collapse] = []

    def _root(self, root: int) -> int:
        return int(self.tr.fs.find(torch.tensor([root]))[0])

    def find(self, root: int) -> Collapse | None:
        """The pending collapse whose class is now `root`, if any."""
        return next((c for c in self.pending if self._root(c.root) == root), None)

    def start(self, column: str, root: int, t: torch.Tensor, reason: str) -> None:
        """`t` carries all features of `column` in one class `root`: pending until its module returns."""
        stack = self.tr.stack
        holders = [d for d, name in enumerate(stack) if name == "" or column.startswith(name + ".")]
        ids = self.tr.fs.distinct(compact(self.tr.shadow(t)))
        self.pending.append(Collapse(root, ids, reason, self.tr.where(), holders[-1] if holders else -1, [t]))

    def single_class(self, s: Ids) -> Collapse | None:
        """The pending collapse whose class is every id of shadow `s`, if any."""
        if not self.pending:
            return None
        roots = self.tr.fs.find(compact(s)).reshape(-1)
        if roots.numel() == 0 or not bool((roots == roots[0]).all()):
            return None
        return self.find(int(roots[0]))

    def read_by(self, s: Ids) -> bool:
        """A layer reads shadow `s`: if it is a pending collapse, that collapse fails (True: read it whole)."""
        c = self.single_class(s)
        if c is None:
            return False
        self._fail(c)
        return True

    def module_returns(self, depth: int) -> None:
        """The module at stack position `depth` returns: settle the collapses it held."""
        ending = [c for c in self.pending if c.depth >= depth]
        if not ending:
            return
        _, needed = self.tr.fs.needs()
        for c in ending:
            if bool((needed == self._root(c.root)).any()):
                self.pending.remove(c)  # a key/value unit every query unit reads: replicated, not split
            else:
                self._fail(c)

    def finish(self) -> None:
        for c in list(self.pending):
            self._fail(c)

    def _fail(self, c: Collapse) -> None:
        self.pending.remove(c)
        self.tr.poison(c.ids, c.reason, where=c.where)
        for t in c.tensors:
            self.tr.set_shadow(t, None)
