"""Shadows: per-element feature ids that follow the data, and the operations every rule is built from.

While the model runs on a tiny input (trace.py), every tensor that derives from the output features of a
column candidate carries a *shadow*: an int64 tensor of the same shape holding, per element, the id of
the feature it belongs to (-1: derives from no split feature). `Shadows` holds the building blocks the
per-op rules (oprules.py) combine:

- `structural`: run the very op on the shadows (view, transpose, cat, getitem move ids with the data);
- `elementwise`: pair the elements of several operands: paired features must share a device (union),
  unless the same element meets several others (a repeated key/value head: a `needs` edge); a whole
  tensor that varies along a dimension forces the features along it together;
- `reduce` and `matmul_ids`: union what a reduction or a contraction mixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .features import FeatureSet, Ids, compact, compact_pair


@dataclass
class Call:
    func: Callable
    name: str
    args: tuple
    kwargs: dict
    out: Any
    inplace: bool = False  # a trailing-underscore op: the result is written into args[0]



class Shadows:
    """The building blocks, bound to a tracer that owns the shadows (`shadow`, `set_shadow`, `poison`, `fs`)."""

    def __init__(self, tracer) -> None:
        self.tr = tracer
        self.fs: FeatureSet = tracer.fs

    def _assign(self, call: Call, out: Any, shadows: Any) -> None:
        tensors = tensors_of(out)
        ids = [shadows] if isinstance(shadows, torch.Tensor) else list(shadows)
        if len(tensors) != len(ids):
            self._poison_inputs(call, f"{call.name}: outputs could not be matched")
            return
        for t, s in zip(tensors, ids):
            if s is None:
                self.tr.set_shadow(t, None)
                continue
            if tuple(s.shape) != tuple(t.shape):
                self._poison_inputs(call, f"{call.name}: shadow shape {tuple(s.shape)} != {tuple(t.shape)}")
                return
            tracked = compact(s) >= 0
            if bool(tracked.any()) and not bool(tracked.all()):
                self.tr.poison(s, f"{call.name} mixes split features with whole values")
            self.tr.set_shadow(t, s if bool(tracked.any()) or s.numel() == 0 else None)

    def _poison_inputs(self, call: Call, reason: str) -> None:
        for ids in self._input_shadows(call):
            self.tr.poison(ids, reason)
        self._clear_outputs(call)

    def _clear_outputs(self, call: Call) -> None:
        for t in tensors_of(call.out):
            self.tr.set_shadow(t, None)

    def _input_shadows(self, call: Call) -> list[Ids]:
        out = []
        for t in tree_flatten((call.args, call.kwargs))[0]:
            if isinstance(t, torch.Tensor):
                s = self.tr.shadow(t)
                if s is not None:
                    out.append(s)
        return out

    def sh(self, t: Any) -> Ids | None:
        return self.tr.shadow(t) if isinstance(t, torch.Tensor) else None

    # -- building blocks --------------------------------------------------------------------------------

    def structural(self, call: Call, data: tuple[int, ...] = (0,)) -> Any:
        """Run the same op on the shadows. Positional args in `data` are the data being moved (an untracked
        one becomes a -1 shadow; a list there is a list of data, as in cat); every other tensor is an index
        or a shape and must not be split."""

        def as_data(t):
            if not isinstance(t, torch.Tensor):
                return t
            s = self.tr.shadow(t)
            return s if s is not None else torch.full(tuple(t.shape), -1, dtype=torch.long)

        def as_index(t):
            if not isinstance(t, torch.Tensor):
                return t
            if self.tr.shadow(t) is not None:
                raise Unfollowable(f"{call.name} uses split values as an index or a shape")
            if t.is_meta:
                raise Unfollowable(f"{call.name} indexes with a tensor whose values are unknown (meta)")
            return t.detach().to("cpu")

        args = []
        for i, a in enumerate(call.args):
            if i in data:
                a = [as_data(t) for t in a] if isinstance(a, (list, tuple)) else as_data(a)
                args.append(a.clone() if call.inplace and isinstance(a, torch.Tensor) else a)
            else:
                args.append(tree_map(as_index, a))
        kwargs = {k: (as_data(v) if k in ("src", "source", "values", "value") else tree_map(as_index, v)) for k, v in call.kwargs.items()}
        if call.name == "view" and not any(isinstance(a, torch.dtype) for a in args[1:]):
            # A shadow may be an expanded view where the real tensor is contiguous: reshape, same ids.
            return torch.Tensor.reshape(*args, **kwargs)
        return call.func(*args, **kwargs)

    def elementwise(self, out_shape, operands: list, extra: list[Ids] = ()) -> Ids:
        """Shadow of an element-wise op's output from its tensor operands (tracked or not) and `extra`
        shadows of operands that are not tensors of their own (a fused bias add)."""
        shape = tuple(out_shape)
        tracked = [_broadcast(self.sh(t), shape) for t in operands if self.sh(t) is not None]
        tracked += [_broadcast(s, shape) for s in extra]
        result = tracked[0]
        for other in tracked[1:]:
            result = self.combine(result, other)
        for t in operands:
            if isinstance(t, torch.Tensor) and self.sh(t) is None:
                for d in varying_dims(tuple(t.shape), _strides(t), shape):
                    self.fs.union_along(result, d)
        return result

    def combine(self, a: Ids, b: Ids) -> Ids:
        """Pair two tracked shadows of one shape element by element (see `FeatureSet.relation`): on raw ids,
        so sharing means the very same element meets several others (a repeated key/value head)."""
        ca, cb = compact_pair(a, b)
        both = (ca >= 0) & (cb >= 0)
        if bool(both.any()):
            kind = self.fs.relation(ca[both], cb[both])
            if kind == "a_shared":
                self.fs.add_needs(cb[both], ca[both])
                return torch.where(b >= 0, b, a)
            if kind == "b_shared":
                self.fs.add_needs(ca[both], cb[both])
            else:
                self.fs.union(ca[both], cb[both])
        return torch.where(a >= 0, a, b)

    def reduce(self, ids: Ids, dims: list[int], outs: list[torch.Tensor]) -> list[Ids]:
        """Union over `dims`; every output gets the reduced shadow, broadcast to its shape."""
        nd = ids.dim()
        dims = sorted({d % nd for d in dims}) if nd else []
        for d in dims:
            self.fs.union_along(ids, d)
        rep = ids
        for d in dims:
            rep = rep.narrow(d, 0, 1)
        shadows = []
        for o in outs:
            r = rep
            if o.dim() < nd:
                for d in reversed(dims):
                    r = r.squeeze(d)
            if r.dim() != o.dim():
                raise Unfollowable("reduction to an unexpected shape")
            shadows.append(r.expand(o.shape))
        return shadows

    def matmul_ids(self, a: torch.Tensor, sa: Ids | None, b: torch.Tensor, sb: Ids | None) -> Ids:
        """Shadow of a @ b, (..., n, k) @ (..., k, m), with torch.matmul's handling of 1-d operands.

        The contraction unions k on each side. With one side split, the other side must not vary along the
        batch dimensions (else those features mix); with both split, each batch position pairs one class of
        a with one of b: union them, or, when one side repeats (grouped KV heads), record `needs`."""
        a_vec, b_vec = a.dim() == 1, b.dim() == 1
        ashape = (1, *a.shape) if a_vec else tuple(a.shape)
        bshape = (*b.shape, 1) if b_vec else tuple(b.shape)
        batch = tuple(torch.broadcast_shapes(ashape[:-2], bshape[:-2]))
        n, m = ashape[-2], bshape[-1]
        if sa is not None:
            sa = sa.reshape(ashape)
            self.fs.union_along(sa, -1)
            sa = _broadcast(sa[..., 0], (*batch, n)).clone()
        if sb is not None:
            sb = sb.reshape(bshape)
            if sa is not None:
                self.fs.mark_kv(sb)  # the right operand of a product of two split tensors: keys, values
            self.fs.union_along(sb, -2)
            sb = _broadcast(sb[..., 0, :], (*batch, m)).clone()
        if sa is not None and sb is None:
            for d in varying_dims(bshape[:-2], _strides(b)[:-2] if not b_vec else (), batch):
                self.fs.union_along(sa, d)
            out = sa.unsqueeze(-1).expand(*batch, n, m)
        elif sb is not None and sa is None:
            for d in varying_dims(ashape[:-2], _strides(a)[:-2] if not a_vec else (), batch):
                self.fs.union_along(sb, d)
            out = sb.unsqueeze(-2).expand(*batch, n, m)
        elif sa is not None and sb is not None:
            self.fs.union_along(sa, -1)
            self.fs.union_along(sb, -1)
            ra, rb = sa[..., 0], sb[..., 0]  # one class per batch position on each side
            kind = self.fs.relation(*(x.reshape(-1) for x in compact_pair(ra, rb)))
            if kind == "a_shared":
                self.fs.add_needs(rb, ra)
                out = sb.unsqueeze(-2).expand(*batch, n, m)
            else:
                if kind == "b_shared":
                    self.fs.add_needs(ra, rb)
                else:
                    self.fs.union(ra, rb)
                out = sa.unsqueeze(-1).expand(*batch, n, m)
        else:
            raise Unfollowable("matmul without split operands")
        if a_vec:
            out = out.squeeze(-2)
        if b_vec:
            out = out.squeeze(-1)
        return out


class Unfollowable(Exception):
    """A rule cannot follow this call: the features it touches are poisoned (kept whole)."""


def tensors_of(out: Any) -> list[torch.Tensor]:
    """The tensors in an op's output, in order (tuples, lists, dicts, named tuples)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in tensors_of(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in tensors_of(o)]
    return []


def _broadcast(ids: Ids, shape: tuple) -> Ids:
    if ids.dim() < len(shape):
        ids = ids.reshape((1,) * (len(shape) - ids.dim()) + tuple(ids.shape))
    return ids.expand(shape)


def _strides(t: torch.Tensor) -> tuple:
    try:
        return tuple(t.stride())
    except RuntimeError:  # sparse or nested tensors: assume nothing is broadcast
        return (1,) * t.dim()


def varying_dims(shape: tuple, strides: tuple, out_shape: tuple) -> list[int]:
    """Dims of `out_shape` along which a right-aligned tensor of `shape` takes more than one value."""
    offset = len(out_shape) - len(shape)
    strides = tuple(strides) if len(strides) == len(shape) else (1,) * len(shape)
    return [i + offset for i, (size, stride) in enumerate(zip(shape, strides)) if size > 1 and stride != 0 and i + offset >= 0]


def _arg(call: Call, pos: int, key: str, default: Any = None) -> Any:
    if len(call.args) > pos:
        return call.args[pos]
    return call.kwargs.get(key, default)


def _as_dims(dim, nd: int) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return list(range(nd))
    if isinstance(dim, (list, tuple, torch.Size)):
        return [int(d) for d in dim]
    return [int(dim)]


# --- the rules ------------------------------------------------------------------------------------------
