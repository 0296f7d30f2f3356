"""From the units found by a trace to the layout a plan writes: blocks, head counts, head attributes.

A *group* is a set of column layers and the row layers that consume their features (one attention, one
MLP). Its units (feature classes) come in two kinds: *query units*, and *key/value units* that query units
need (grouped-query attention). Reading each layer's features left to right gives a sequence of units; a
layout a plan can express is a concatenation of blocks, each one pass over all units of one kind in the
same order, every unit taking the same number of features:

    q_proj  [q0 q0 q0 q0 | q1 q1 q1 q1 | ...]        -> ("q",)           head_dim 4
    c_attn  [q0.. q1.. | k0.. k1.. | v0.. v1..]       -> ("q", "kv", "kv") (fused, GPT-2)
    qkv     [q0 x12 | q1 x12 | ...] with o_proj x4    -> ("q*3",)          (interleaved, GPT-NeoX)
    gate_up [u0 u1 ... u175 | u0 u1 ... u175]         -> (176, 176)        (plain units of one feature)

With units of one feature and no key/value units the group is *plain* (int blocks, no Heads entry);
otherwise it is an attention group: ``Heads(num_heads=len(Q), num_kv_heads=len(K))`` on the smallest module
holding all its layers, where query unit h must need key/value unit h // (len(Q) // len(K)), the grouping
that `HeadGroups` keeps on one device.

Which integer attributes of that module to localise (the counts its forward reshapes with) is read from
their values: an attribute equal to the number of heads becomes "heads", and so on; names decide only
between quantities whose values collide.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..partition import HeadGroups


class LayoutError(ValueError):
    """The group's features are laid out in a way blocks cannot express (or are inconsistent)."""


@dataclass
class Layout:
    """The blocks of every layer of a group, and its head geometry (None for a plain group)."""

    blocks: dict[str, tuple[int | str, ...]]  # layer name -> blocks of its split dimension
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None  # features per query head in the row (output) projection
    kv_head_dim: int | None = None
    units: int = 0
    kv_blocks: bool = False  # some layer has "kv" blocks (then Heads states num_kv_heads explicitly)

    @property
    def heads(self) -> bool:
        return self.num_heads is not None


def runs(labels: torch.Tensor) -> list[tuple[int, int]]:
    """Run-length encoding: [5, 5, 7] -> [(5, 2), (7, 1)]."""
    if labels.numel() == 0:
        return []
    values, counts = torch.unique_consecutive(labels, return_counts=True)
    return list(zip(values.tolist(), counts.tolist()))


def infer_layout(
    members: dict[str, torch.Tensor], needs: dict[int, set[int]], kv_side: dict[str, torch.Tensor] | None = None
) -> Layout:
    """`members`: layer name -> class label of each of its split features, columns first in call order.
    `needs`: query class -> the key/value classes it needs (within this group).
    `kv_side`: layer name -> which of its features attention reads as keys/values; names the blocks of
    k and v projections "kv" when every head has its own (multi-head attention)."""
    kv_units = set().union(*needs.values()) if needs else set()
    order_q: list[int] = []
    order_kv: list[int] = []
    seen: set[int] = set()
    encoded = {name: runs(labels) for name, labels in members.items()}
    for rl in encoded.values():
        for unit, _ in rl:
            if unit not in seen:
                seen.add(unit)
                (order_kv if unit in kv_units else order_q).append(unit)
    index_kv = {u: i for i, u in enumerate(order_kv)}

    passes: dict[str, list[tuple[str, int]]] = {}  # layer -> [(kind, features per unit)]
    for name, rl in encoded.items():
        out, i, start = [], 0, 0
        while i < len(rl):
            unit = rl[i][0]
            kind, order = ("kv", order_kv) if unit in index_kv else ("q", order_q)
            chunk = rl[i : i + len(order)]
            if [u for u, _ in chunk] != order:
                raise LayoutError(
                    f"{name}: its features visit the {'key/value ' if kind == 'kv' else ''}units in an order "
                    "that is not one pass per block (interleaved or partial use of a fused layer)"
                )
            sizes = {n for _, n in chunk}
            if len(sizes) != 1:
                raise LayoutError(f"{name}: units of unequal size ({sorted(sizes)} features)")
            size = sizes.pop()
            stop = start + size * len(order)
            if kind == "q" and kv_side is not None and name in kv_side and bool(kv_side[name][start:stop].all()):
                kind = "kv"  # multi-head attention: a key or value projection, one unit per query head
            out.append((kind, size))
            i, start = i + len(order), stop
        passes[name] = out

    plain = not order_kv and all(kind == "q" and n == 1 for p in passes.values() for kind, n in p)
    if plain:
        return Layout({name: tuple(len(order_q) for _ in p) for name, p in passes.items()}, units=len(order_q))

    if all(kind == "kv" for p in passes.values() for kind, _ in p):
        raise LayoutError("every split feature is read as a key or value; no query heads")
    nh, nkv = len(order_q), len(order_kv) or len(order_q)
    if order_kv:
        if nh % nkv:
            raise LayoutError(f"{nh} query heads do not group evenly over {nkv} key/value heads")
        group = nh // nkv
        for h, unit in enumerate(order_q):
            wanted = {order_kv[h // group]}
            if needs.get(unit, set()) != wanted:
                raise LayoutError(
                    f"query head {h} reads key/value heads {sorted(index_kv[k] for k in needs.get(unit, ()))}, "
                    f"not {h // group}: not the grouping of grouped-query attention"
                )
    # Features per head: the smallest unit seen (q_proj and o_proj: head_dim; a fused q|k|v per head: 3x).
    head_dim = min((n for p in passes.values() for kind, n in p if kind == "q"), default=None)
    kv_head_dim = min((n for p in passes.values() for kind, n in p if kind == "kv"), default=None)
    blocks: dict[str, tuple[int | str, ...]] = {}
    for name, p in passes.items():
        # In head_dims where they divide ("q*3": q, k and v of each head side by side), else in this layer's
        # own unit (block_partition derives a layer's head size from its width and its blocks).
        base = {"q": head_dim, "kv": head_dim}  # k|v of one head side by side (MQA, fused): "kv*2"
        if not all(n % base[kind] == 0 for kind, n in p):
            unit = math.gcd(*(n for _, n in p))
            base = {"q": unit, "kv": unit}
        blocks[name] = tuple(kind if n == base[kind] else f"{kind}*{n // base[kind]}" for kind, n in p)
    # A key/value unit is a key head and its value head: one or two head_dims of features over all layers
    # (k_proj and v_proj, or k|v side by side in a fused layer). A shared unit of another size is something
    # else (a state-space mixer's input read by every channel), not grouped-query attention.
    kv_total = sum(n for p in passes.values() for kind, n in p if kind == "kv")
    if order_kv and kv_total not in (head_dim, 2 * head_dim):
        raise LayoutError(
            f"the shared units hold {kv_total} features and the others {head_dim}: not key/value heads of "
            "grouped-query attention"
        )
    uses_kv = any(kind == "kv" for p in passes.values() for kind, _ in p)
    return Layout(
        blocks, num_heads=nh, num_kv_heads=nkv, head_dim=head_dim, kv_head_dim=kv_head_dim or head_dim, units=nh,
        kv_blocks=uses_kv,
    )


# --- head-count attributes ------------------------------------------------------------------------------

_NOT_COUNTS = re.compile(r"(idx|index|layer|head_dim|(?<!all_)head_size|dim_head|per_head|rotary|rope|window|position|max|"
                         r"seq|vocab|bucket|stride|chunk|expert|rank|lora|pad|token|id$|_id|seed|block_size)", re.I)
# Names decide between quantities with colliding values, most specific first.
_HINTS = [
    ("groups", re.compile(r"(group|rep|per_kv|queries_per|q_per)", re.I)),
    ("kv_features", re.compile(r"(kv|key_value).*(size|dim|features)|(size|dim|features).*(kv|key_value)", re.I)),
    ("kv_heads", re.compile(r"(kv|key_value|key|value)", re.I)),
    ("heads", re.compile(r"head", re.I)),
    ("features", re.compile(r"(size|dim|features|hidden|embed|inner|all_head|width)", re.I)),
]


def head_attrs(owner: nn.Module, layout: Layout, world_size: int, inner: tuple[str, ...] = ()) -> dict[str, str]:
    """The integer attributes of `owner` that hold a head count (or a width derived from one), mapped to
    the quantity each device must see: heads, kv_heads, groups or features or kv_features. `inner` names
    submodules of `owner` (relative paths) that reshape into heads too: the module holding q, k and v when
    the owner also holds the output projection in a sibling (BERT-style ``attention.self`` beside
    ``attention.output``); their attributes come back as dotted paths (``self.all_head_size``)."""
    nh, nkv = layout.num_heads, layout.num_kv_heads
    values = {"heads": nh, "kv_heads": nkv, "groups": nh // nkv}
    if layout.head_dim:
        values["features"] = nh * layout.head_dim
        values["kv_features"] = nkv * (layout.kv_head_dim or layout.head_dim)
    try:
        local = [HeadGroups.build(nh, nkv, world_size).local(r) for r in range(world_size)]
    except ValueError:
        local = []
    for r, counts in enumerate(local):
        if layout.head_dim:
            counts["features"] = counts["heads"] * layout.head_dim
            counts["kv_features"] = counts["kv_heads"] * (layout.kv_head_dim or layout.head_dim)
    attrs = _count_attrs(owner, values, local)
    for path in inner:
        sub = owner.get_submodule(path)
        attrs.update({f"{path}.{attr}": quantity for attr, quantity in _count_attrs(sub, values, local).items()})
    # Head counts read from a config object at forward time (Phi-3 slices its fused q|k|v with
    # config.num_attention_heads). Only names that are head counts; the Heads style copies the config.
    config = getattr(owner, "config", None)
    if config is not None and not isinstance(config, nn.Module) and hasattr(config, "__dict__"):
        for attr, value in vars(config).items():
            if isinstance(value, bool) or not isinstance(value, int) or not _CONFIG_COUNTS.fullmatch(attr):
                continue
            for quantity, pattern in _HINTS:
                if quantity in ("heads", "kv_heads", "groups") and values[quantity] == value and pattern.search(attr):
                    attrs[f"config.{attr}"] = quantity
                    break
    return attrs


def _count_attrs(module: nn.Module, values: dict[str, int], local: list[dict[str, int]]) -> dict[str, str]:
    """`module`'s own integer attributes whose value is one of the global quantities in `values`, by name
    where values collide (a hidden size equal to heads x head_dim)."""
    attrs: dict[str, str] = {}
    for attr, value in vars(module).items():
        if attr.startswith("_") or isinstance(value, bool) or not isinstance(value, int):
            continue
        if _NOT_COUNTS.search(attr):
            continue
        matches = [q for q, v in values.items() if v == value]
        if not matches:
            continue
        if len(matches) > 1:
            hinted = [q for q, pattern in _HINTS if q in matches and pattern.search(attr)]
            if hinted:
                matches = hinted[:1]
            elif not (local and all(len({c[q] for q in matches}) == 1 for c in local)):
                continue  # ambiguous and it matters: leave it (the self-check tells if it was needed)
        attrs[attr] = matches[0]
    return attrs


_CONFIG_COUNTS = re.compile(
    r"num_attention_heads|num_key_value_heads|n_head|n_heads|num_heads|n_kv_heads|num_kv_heads|"
    r"multi_query_group_num|n_head_kv|num_key_value_groups|kv_n_heads|num_query_groups"
)
