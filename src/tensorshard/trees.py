"""Flattening what a model takes and returns into tensors and back, dataclasses included.

    leaves, spec = flatten(out)          # Out(logits=..., hidden=...) -> [logits, hidden]
    out = unflatten(leaves, spec)        # a copy of Out with the new leaves

torch's pytrees see into tuples, lists, dicts and the classes registered with them (transformers registers
its ModelOutputs), but a plain ``@dataclass`` a user's forward returns is one opaque leaf: its tensors would
pass a shard boundary without being gathered or checked, and device 0's object would come back holding
device 0's slices. Here such a dataclass is a node too: its fields (`dataclasses.fields`) are flattened,
and rebuilding makes a shallow copy of the original object with the fields replaced (frozen ones too),
so its class, its other attributes and its methods stay as they were.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten


@dataclasses.dataclass(frozen=True)
class _Fields:
    """A dataclass object among the leaves: how many leaves its fields became, and how to rebuild it."""

    count: int
    original: Any
    names: tuple[str, ...]
    spec: "Spec"


@dataclasses.dataclass(frozen=True)
class Spec:
    outer: TreeSpec
    parts: tuple[_Fields | None, ...]  # per leaf of `outer`: None for a leaf kept as it is


def flatten(tree: Any) -> tuple[list, Spec]:
    leaves, outer = tree_flatten(tree)
    flat, parts = [], []
    for leaf in leaves:
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            names = tuple(f.name for f in dataclasses.fields(leaf))
            inner, spec = flatten([getattr(leaf, n) for n in names])
            parts.append(_Fields(len(inner), leaf, names, spec))
            flat.extend(inner)
        else:
            parts.append(None)
            flat.append(leaf)
    return flat, Spec(outer, tuple(parts))


def unflatten(leaves: list, spec: Spec) -> Any:
    out, i = [], 0
    for part in spec.parts:
        if part is None:
            out.append(leaves[i])
            i += 1
            continue
        values = unflatten(list(leaves[i:i + part.count]), part.spec)
        i += part.count
        rebuilt = copy.copy(part.original)
        for name, value in zip(part.names, values):
            object.__setattr__(rebuilt, name, value)  # frozen dataclasses too
        out.append(rebuilt)
    return tree_unflatten(out, spec.outer)
