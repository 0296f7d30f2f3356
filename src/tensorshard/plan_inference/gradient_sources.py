"""Which whole tensors of a traced pass would carry gradients, and where those gradients would go.

The pass runs without autograd (memory); instead each floating-point tensor it makes records its *source*:
the parameters it is computed from, when it is computed from parameters alone (a norm weight, ``1 + weight``),
or LONG when it derives from activations (a hidden state, a layer's output). A tensor without a record is a
parameter (its own source, if trainable), an activation (LONG, if it requires a gradient), or a constant.

When split features meet a whole tensor that has a source, each device would see only part of that tensor's
gradient: parameters computed into it directly can have their gradients summed (a `Sync`); a tensor computed
from activations cannot, so the features are poisoned.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch import nn

from .evidence import Sync
from .features import FeatureSet, Ids, compact
from .shadows import tensors_of

LONG = "long"  # the source of a tensor computed from activations

Source = frozenset | str | None  # parameter ids, LONG, or None (no gradient)


class TraceState(Protocol):
    """What gradient sources read and change of the trace they belong to (tracer.py's Tracer)."""

    fs: FeatureSet
    syncs: list[Sync]

    def shadow(self, t: torch.Tensor) -> Ids | None: ...
    def poison(self, ids: Ids, reason: str, kind: str = "op", where: str | None = None) -> None: ...


class GradientSources:
    """The source of every floating-point tensor of one traced pass (see the module docstring)."""

    def __init__(self, tracer: TraceState, model: nn.Module) -> None:
        self.tr = tracer
        self._sources: dict[int, tuple[weakref.ref, Any]] = {}
        self.param_names: dict[int, tuple[str, str]] = {}  # id(parameter) -> (owning module, parameter name)
        for mname, mod in model.named_modules():
            for pname, p in mod._parameters.items():
                if p is not None:
                    self.param_names.setdefault(id(p), (mname, pname))

    def of(self, t: torch.Tensor) -> Source:
        if id(t) in self.param_names:
            return frozenset([id(t)]) if t.requires_grad else None
        entry = self._sources.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else (LONG if t.requires_grad else None)

    def set(self, t: torch.Tensor, value: Source) -> None:
        if value is None:
            self._sources.pop(id(t), None)
        else:
            self._sources[id(t)] = (weakref.ref(t), value)

    def record(self, leaves: list[torch.Tensor], out: Any, tracked: bool) -> None:
        """The source of an op's outputs: LONG when it read split features or an activation, else the union of
        the parameters its inputs come from."""
        found: set[int] = set()
        value = LONG if tracked else None
        if value is None:
            for t in leaves:
                s = self.of(t)
                if s is LONG:
                    value = LONG
                    break
                if s:
                    found |= s
            else:
                value = frozenset(found) if found else None
        for t in tensors_of(out):
            if t.is_floating_point() or t.is_complex():
                self.set(t, value)

    def meet(self, name: str, leaves: list[torch.Tensor], tracked: list[Ids]) -> None:
        """The op `name` combined the split features `tracked` with `leaves`: a whole leaf with a gradient gets only
        part of it on each device. Parameters computed into it directly can have their gradients summed
        (SumGradients: a Sync); a tensor computed from activations cannot: poison."""
        ids = torch.cat([compact(t).reshape(-1) for t in tracked])
        for t in leaves:
            if self.tr.shadow(t) is not None or t.numel() == 0:
                continue
            s = self.of(t)
            if s is LONG:
                self.tr.poison(ids, f"{name} combines split features with a whole tensor whose gradient would be partial",
                               kind="gradient")
            elif s:
                self.tr.syncs.append(Sync([self.param_names[p] for p in s], self.tr.fs.distinct(ids)))
