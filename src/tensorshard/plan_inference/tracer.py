"""Intercepting torch functions: the `Tracer`, a `TorchFunctionMode` every torch function and tensor method of the
traced model passes through, and the state of one traced pass.

The Tracer keeps a *shadow* per tensor that carries split features (the ids of the features each element
belongs to: shadows.py) and, for each call that reads one, applies the op's rule (oprules.py), notes where
gradients would meet whole tensors (gradient_sources.py) and whether a column's features just fell into one
unit (collapses.py). It also notes a layer's parameters read outside the layer's own forward (a tied head
computed with ``F.linear``: the layer stays whole), and which tensors are the model's own inputs or derive from
them by shape ops and integer arithmetic (ids an embedding may look up). Module calls are hooked separately
(layer_roles.py), which suspends the mode inside each supported layer.

On a meta model, tensor factories (``arange``, ``zeros``, ...) build real CPU tensors, so values that do not
depend on parameters (position ids, masks) are computed for real and data-dependent checks in the model's code
still work; a real tensor meeting a meta one goes to meta.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from .collapses import Collapses
from .evidence import Poison, Sync
from .features import FeatureSet, Ids, compact
from .gradient_sources import GradientSources
from .head_counts import FixedCount, note as note_head_count, sizes as head_sizes
from .layer_roles import LayerRoles
from .oprules import Call, IDENTITY, NO_TRACK, Rules, STRUCTURAL, tensors_of

_FACTORIES = set(
    "arange zeros ones full empty tensor as_tensor rand randn randint randperm eye linspace logspace "
    "empty_strided scalar_tensor tril_indices triu_indices zeros_like ones_like full_like empty_like".split()
)


class Tracer(TorchFunctionMode):
    """One traced pass over `model` (see the module docstring); trace.py's `trace_model` runs it."""

    def __init__(self, model: nn.Module, fixed: set[str], *, capture: bool, meta: bool,
                 columns: set[str] | None = None, log: bool = False) -> None:
        super().__init__()
        self.fs = FeatureSet()
        if log:
            self.fs.log = []
        self.rules = Rules(self)
        self.meta = meta
        self.suspended = 0
        self.stack: list[str] = []
        self._shadows: dict[int, tuple[torch.Tensor, Ids]] = {}
        self._derived: dict[int, torch.Tensor] = {}  # tensors derived from the model's inputs by shape ops
        self.poisons: list[Poison] = []
        self.syncs: list[Sync] = []
        self.fixed_counts: list[FixedCount] = []  # reshapes of split features by an explicit head count
        self.collapses = Collapses(self)
        self.sources = GradientSources(self, model)
        self.roles = LayerRoles(self, model, fixed, capture=capture, columns=columns)

    # -- shadows ---------------------------------------------------------------------------------------

    def shadow(self, t: torch.Tensor) -> Ids | None:
        entry = self._shadows.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else None

    def set_shadow(self, t: torch.Tensor, ids: Ids | None) -> None:
        if ids is None:
            self._shadows.pop(id(t), None)
        else:
            self._shadows[id(t)] = (t, ids)

    def poison(self, ids: Ids, reason: str, kind: str = "op", where: str | None = None) -> None:
        ids = self.fs.distinct(ids)
        if ids.numel():
            self.poisons.append(Poison(ids, reason, where or self.where(), kind))

    def where(self) -> str:
        return (self.stack[-1] if self.stack else "") or "<model>"

    def mark_inputs(self, tree: Any) -> None:
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor):
                self._derived[id(t)] = t

    def derived(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and self._derived.get(id(t)) is t

    # -- the mode --------------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.suspended:
            return func(*args, **kwargs)
        name = _name(func)
        if name in ("size", "shape") and args and self.shadow(args[0]) is not None:
            # a head count computed from this size is the device's own (head_counts.py)
            return head_sizes(func(*args, **kwargs), args[0], self.shadow(args[0]), args)
        if name in NO_TRACK:
            return func(*args, **kwargs)
        if self.meta:
            args, kwargs = self._meta_args(name, args, kwargs)
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for t in leaves:
            owners = self.roles.param_owner.get(id(t))
            if owners:
                for owner in owners:
                    self.roles.layers[owner].foreign.append(f"{name} in {self.where()}")
        out = func(*args, **kwargs)
        if self.meta and name in ("to", "cuda", "type_as") and isinstance(out, torch.Tensor):
            if out.is_meta and args and isinstance(args[0], torch.Tensor) and not args[0].is_meta:
                out = args[0].to(dtype=out.dtype)  # keep values that do not depend on weights real
        tracked = [self.shadow(t) for t in leaves if self.shadow(t) is not None]
        self.sources.record(leaves, out, bool(tracked))
        if tracked:
            self.suspended += 1
            try:
                self.fs.op = f"{name} in {self.where()}"
                if len(tracked) == 1 and args and self.shadow(args[0]) is not None:
                    note_head_count(name, args, out, self.shadow(args[0]), self.where(), self.fixed_counts)
                self.rules.apply(Call(func, name, args, kwargs, out))
                self.sources.meet(name, leaves, tracked)
                self._collapsed(name, out)
            finally:
                self.suspended -= 1
        elif leaves and any(self.derived(t) for t in leaves):
            # Ids stay ids through shape ops and integer arithmetic (a clamp, a where, an offset).
            shaped = name in STRUCTURAL or name in IDENTITY
            for t in tensors_of(out):
                if shaped or not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
                    self._derived[id(t)] = t
        return out

    def _collapsed(self, name: str, out: Any) -> None:
        """Once one class holds every feature of a column, its group has a single unit: it cannot split,
        unless it is the one key/value head of multi-query attention. Pending until the module holding the
        column returns (collapses.py), the tensors carrying that class are remembered."""
        for t in tensors_of(out):
            s = self.shadow(t)
            if s is None:
                continue
            roots = self.fs.find(compact(s)).reshape(-1)
            if roots.numel() == 0 or not bool((roots == roots[0]).all()):
                continue
            root = int(roots[0])
            pending = self.collapses.find(root)
            if pending is not None:
                pending.tensors.append(t)
                continue
            for info in self.roles.layers.values():
                ids = info.out_ids
                if ids is not None and ids.numel() > 1 and bool((self.fs.find(ids) == root).all()):
                    reason = f"{name} mixes all output features of {info.name}; nothing is left to split"
                    self.collapses.start(info.name, root, t, reason)
                    break

    def _meta_args(self, name: str, args: tuple, kwargs: dict):
        """On a meta model: factories build real CPU tensors; a real tensor meeting a meta one goes meta."""
        if name in _FACTORIES or name.startswith("new_"):
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "meta":
                kwargs = dict(kwargs, device="cpu")
            return args, kwargs
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(t.is_meta for t in leaves) and not all(t.is_meta for t in leaves):
            to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) and not t.is_meta else t  # noqa: E731
            new_args, new_kwargs = tree_map(to_meta, (args, kwargs))
            for old, new in zip(tree_flatten((args, kwargs))[0], tree_flatten((new_args, new_kwargs))[0]):
                if isinstance(old, torch.Tensor) and new is not old and self.shadow(old) is not None:
                    self.set_shadow(new, self.shadow(old))
            return new_args, new_kwargs
        return args, kwargs


def _name(func) -> str:
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":  # a tensor property such as .shape or .T
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name
