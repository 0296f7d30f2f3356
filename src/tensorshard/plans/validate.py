"""Checks that the layouts of a plan fit together, run by `shard_plan` before anything is split.

A column-parallel layer without ``gather_output`` hands its output on still split: device r holds the
features in its ranges. Whoever reads that output must expect exactly those ranges, or the answer is
wrong; often silently, because the slices have the right sizes and only the wrong contents (a fused
gate|up layer split in one plain block gives device 0 all of gate and device 1 all of up). These checks
use only the plan, the module tree and the weight shapes, no forward pass:

1. `Heads` attributes hold the full-model values the entry declares (``attrs={"n_heads": "heads"}``
   with ``num_heads=8`` needs ``n_heads == 8``), so the entry describes this module's geometry.
2. Head-sized projections directly inside a `Heads` module split on that entry's head boundaries, and
   one the size of fused q|k|v (or k|v) for those heads declares its blocks.
3. Each such column layer against its *reader*: the row-parallel layer in the smallest enclosing module
   that has one (q, k, v -> o; gate, up -> down), the first after it in module order, else the last
   before it (see `_first_reader`). Same size: the same
   ranges. A multiple k of the reader's size: the column layer fuses k outputs and must say how they
   are laid out (``blocks``); each block, or each head's interleaved piece, must match the reader.
4. A column layer that no row-parallel layer reads, followed by a replicated layer that reads all of
   its features, is an error (the replicated layer would get a slice). With no reader at all, a
   warning: the split output may be the model's output, which cannot be told from a whole one at run
   time when the slices have equal shapes.
5. A `ChannelParallel` layer (BatchNorm, GroupNorm, depthwise conv) keeps only its devices' channels, so
   its input must arrive split: a column layer with that many output features must produce it, found
   as a reader is (the smallest enclosing module that has one; the last before it, else the first
   after), and split the channels the same way. Without one, every call would fail in torch
   ("running_mean should contain 16 elements not 8"), after the model was consumed.
6. A module whose forward reads its own head count (``self.n_heads``) and whose q/k/v children are
   split column-wise with no `Heads` entry above them: the count stays the whole model's on every
   device while each holds fewer heads, so its reshapes fail (or, with ``-1`` in them, cut heads
   silently). Only modules whose forward source can be read, with an int attribute named like a head
   count (n_heads, num_heads, n_head, num_attention_heads) dividing a split child's outputs.

Errors are ValueErrors naming both layers, the ranges each device would hold, and the fix. What needs a
forward pass (control flow, reshapes in the model's own code) is left to run time: mismatched shapes
fail at the collective, and ``debug=True`` compares the replicated outputs of every device.
"""

from __future__ import annotations

import ast
import bisect
import re
from dataclasses import dataclass

from torch import nn

from ..layers import CONV, CONV1D_HF, LINEAR, layer_kind, weight_shape
from ..logs import get_logger
from ..partition import HeadGroups, Partition, block_partition, parse_block
from ..styles.channel import ChannelParallel, channel_count
from ..styles.column import ColwiseParallel
from ..styles.heads import Heads
from ..styles.row import RowwiseParallel
from ..styles.shard_params import ShardParams
from .direct_reads import _source_tree
from .module_shard import ModuleShard

logger = get_logger(__name__)


@dataclass
class _Layer:
    """A split or replicated layer, as the checks see it."""

    index: int  # position in module order
    name: str
    role: str  # "column" (output left split), "row", "reader" (ShardParams with split input), "replicated"
    size: int  # column: output features; row, replicated: input features
    partition: Partition | None = None
    blocks: tuple | None = None
    heads: HeadGroups | None = None
    style: str = ""


def check_layouts(module: nn.Module, modules: dict[str, ModuleShard], world_size: int) -> None:
    """Raise ValueError if the plan's split layers disagree with each other (see the module docstring)."""
    if world_size == 1:
        return
    names = [name for name, _ in module.named_modules()]
    by_name = dict(module.named_modules())
    _check_heads_attrs(by_name, modules)
    layers = _layers(names, by_name, modules)
    _check_head_alignment(layers, modules, world_size)
    scopes = _scopes(names, by_name)
    readers = [l for l in layers if l.role in ("row", "reader")]
    reader_index = [l.index for l in readers]
    for c in layers:
        if c.role != "column":
            continue
        reader = _first_reader(c, scopes, readers, reader_index)
        if reader is None:
            _check_replicated_reader(c, layers, world_size)
        elif reader.role == "row":
            problem = _compare(c, reader)
            if problem:
                raise ValueError(problem)
    _check_channel_inputs(names, by_name, modules, layers, scopes)
    _check_head_counts(by_name, modules, layers)


def column_readers(module: nn.Module, modules: dict[str, ModuleShard], world_size: int) -> dict[str, str]:
    """Each layer whose output the plan leaves split -> the row-parallel layer check 3 pairs it with (module
    order; plan_inference/plancheck.py names the pair with it when the trace cannot tell)."""
    if world_size == 1:
        return {}
    names = [name for name, _ in module.named_modules()]
    by_name = dict(module.named_modules())
    layers = _layers(names, by_name, modules)
    scopes = _scopes(names, by_name)
    readers = [l for l in layers if l.role in ("row", "reader")]
    reader_index = [l.index for l in readers]
    found = {c.name: _first_reader(c, scopes, readers, reader_index) for c in layers if c.role == "column"}
    return {c: r.name for c, r in found.items() if r is not None and r.role == "row"}


# --- the layers ---------------------------------------------------------------------------------------


def _layers(names: list[str], by_name: dict[str, nn.Module], modules: dict[str, ModuleShard]) -> list[_Layer]:
    out = []
    for index, name in enumerate(names):
        ms = modules.get(name)
        style = ms.style if ms is not None else None
        mod = by_name[name]
        if isinstance(style, ColwiseParallel) and not style.gather_output and "weight" in ms.splits:
            part = ms.splits["weight"][1]
            out.append(_Layer(index, name, "column", part.size, part, style.blocks, ms.heads, style.describe()))
        elif isinstance(style, RowwiseParallel) and "weight" in ms.splits:
            part = ms.splits["weight"][1]
            out.append(_Layer(index, name, "row", part.size, part, style.blocks, ms.heads, style.describe()))
        elif isinstance(style, ShardParams) and style.input == "split":
            out.append(_Layer(index, name, "reader", 0, style=style.describe()))
        elif (ms is None or not ms.splits) and not isinstance(style, (ColwiseParallel, RowwiseParallel, ShardParams)):
            kind = layer_kind(mod)
            if kind in (LINEAR, CONV1D_HF, CONV):
                size = weight_shape(mod)[kind.weight_in_dim]
                if kind is CONV:
                    size *= mod.groups
                out.append(_Layer(index, name, "replicated", size, style=type(mod).__name__))
    return out


def _scopes(names: list[str], by_name: dict[str, nn.Module]) -> dict[str, tuple[int, int, bool]]:
    """For each module: (its index, the index just past its subtree, whether it is an nn.Sequential)."""
    ends = [len(names)] * len(names)
    stack: list[int] = []
    for i, name in enumerate(names):
        while stack and not _inside(name, names[stack[-1]]):
            ends[stack.pop()] = i
        stack.append(i)
    return {n: (i, ends[i], isinstance(by_name[n], nn.Sequential)) for i, n in enumerate(names)}


def _inside(name: str, parent: str) -> bool:
    return parent == "" or name == parent or name.startswith(parent + ".")


def _first_reader(c: _Layer, scopes: dict[str, tuple[int, int, bool]], readers: list[_Layer], reader_index: list[int]) -> _Layer | None:
    """The row-parallel layer that reads `c`'s output: in the smallest enclosing module that has one, the
    first after `c` in module order, else the last before it (modules may register their layers in any
    order: w1, w2, w3 for w2(w1(x) * w3(x))), except in an nn.Sequential, whose order is execution order.

    A module's subtree is a contiguous run of module order, so both are found by bisection."""
    k = bisect.bisect_right(reader_index, c.index)  # readers[k] is the first reader after c
    parts = c.name.split(".") if c.name else []
    for depth in range(len(parts) - 1, -1, -1):
        start, end, sequential = scopes[".".join(parts[:depth])]
        if k < len(readers) and readers[k].index < end:
            return readers[k]
        if not sequential and k > 0 and readers[k - 1].index > start:
            return readers[k - 1]
    return None


# --- 1. Heads attributes ------------------------------------------------------------------------------


def _check_heads_attrs(by_name: dict[str, nn.Module], modules: dict[str, ModuleShard]) -> None:
    seen: set = set()
    for name, ms in modules.items():
        style = ms.style
        if not isinstance(style, Heads):
            continue
        full = {
            "heads": style.num_heads,
            "kv_heads": style.kv,
            "groups": style.num_heads // style.kv,
            "features": style.num_heads * style.head_dim if style.head_dim else None,
            "kv_features": style.kv * style.head_dim if style.head_dim else None,
        }
        _warn_unmapped_counts(name, by_name[name], style, ms.heads, full, seen)
        for path, quantity in style.attrs.items():
            owner = by_name[name]
            for part in path.split("."):
                owner = getattr(owner, part)
            if isinstance(owner, bool) or not isinstance(owner, int) or full[quantity] is None:
                continue
            if owner != full[quantity]:
                raise ValueError(
                    f"{name or '<root>'}: the plan's {style.describe()} makes {path!r} the local number of "
                    f"{quantity}, but the model has {path} = {owner}, not {full[quantity]}. The Heads entry must "
                    f"describe this module's whole attention; fix its counts (num_heads, num_kv_heads, head_dim) "
                    "or the attrs mapping."
                )


_COUNT_NAME = re.compile(r"head|group|rep", re.IGNORECASE)
_NOT_COUNT = re.compile(r"dim|size|idx|index|scal|layer", re.IGNORECASE)


def _warn_unmapped_counts(name: str, module: nn.Module, style: Heads, heads: HeadGroups, full: dict, seen: set) -> None:
    """Warn (once per class and attribute) about the module's own attributes that look like head counts,
    hold the full-model count and are not in attrs: each device would keep the full count while holding
    fewer heads (Phi-3 slices k and v with `self.num_key_value_heads`). Config objects are not scanned:
    most models keep counts there that their forward never reads."""
    local = [heads.local(r) for r in range(heads.world_size)]
    for attr, value in vars(module).items():
        if attr in style.attrs or attr in getattr(style, "values", ()) or isinstance(value, bool) or not isinstance(value, int):
            continue
        if not _COUNT_NAME.search(attr) or _NOT_COUNT.search(attr) or (type(module), attr) in seen:
            continue
        for quantity in ("kv_heads", "heads", "groups"):
            if value == full[quantity] and any(l[quantity] != value for l in local):
                seen.add((type(module), attr))
                logger.warning(
                    "%s: %r = %d looks like the number of %s, but the Heads entry does not list it in attrs, so "
                    "every device keeps %d while holding fewer. If the forward reshapes or slices with it, add "
                    "attrs={%r: %r}.", name or "<root>", attr, value, quantity.replace("_", " "), value, attr, quantity,
                )
                break


# --- 2. head boundaries inside a Heads module ---------------------------------------------------------


def _check_head_alignment(layers: list[_Layer], modules: dict[str, ModuleShard], world: int) -> None:
    owners = {id(ms.heads): name for name, ms in modules.items() if isinstance(ms.style, Heads)}
    by_owner: dict[str, list[_Layer]] = {}
    for l in layers:
        if l.heads is not None and l.role in ("column", "row"):
            by_owner.setdefault(owners[id(l.heads)], []).append(l)
    for owner, members in by_owner.items():
        heads = members[0].heads
        style = modules[owner].style
        children = [l for l in members if l.name.rpartition(".")[0] == owner and not _head_spans(l)]
        dims = {style.head_dim} if style.head_dim else set()
        for l in members:
            dims |= {d for *_, d in _head_spans(l)}
        dims |= {l.size // heads.num_heads for l in children if l.role == "row" and l.size % heads.num_heads == 0}
        for l in children:
            for d in sorted(dims):
                q, kv = heads.num_heads * d, heads.num_kv_heads * d
                if l.blocks is None and kv != q and l.size in (q + 2 * kv, 2 * kv):
                    fused = "q|k|v" if l.size == q + 2 * kv else "k|v"
                    blocks = "('q', 'kv', 'kv')" if fused == "q|k|v" else "('kv', 'kv')"
                    raise ValueError(
                        f"{l.name} ({l.style}) has {l.size} output features, the size of fused {fused} for the "
                        f"{heads.num_heads} query / {heads.num_kv_heads} key-value heads of {d} features that the "
                        f"Heads entry at {owner or '<root>'} declares; a plain split would cut across the blocks. "
                        f"Say how they are laid out: blocks={blocks} for blocks one after the other (or the "
                        f"model's interleaving), or blocks=({l.size},) if one plain split is really meant."
                    )
                unit = "q" if l.size == q else "kv" if l.size == kv else None
                if unit is None:
                    continue
                expected = block_partition(l.size, world, (unit,), heads)
                if l.partition != expected:
                    count = heads.num_heads if unit == "q" else heads.num_kv_heads
                    raise ValueError(
                        f"{l.name} ({l.style}) splits its {l.size} features as {_show(l.partition)}, cutting "
                        f"across the {count} {'query' if unit == 'q' else 'key/value'} heads of {d} features "
                        f"that the Heads entry at {owner or '<root>'} places as {_show(expected)}. Use "
                        f"blocks=({unit!r},) so it splits on the same head boundaries."
                    )
                break


def _head_spans(l: _Layer) -> list[tuple[int, int, str, int]]:
    """(start, stop, kind, head_dim) of each head block of a layer declared with "q"/"kv" blocks."""
    spans = _spans(l)
    return [s for s in spans if s[2] != "plain"]


def _spans(l: _Layer) -> list[tuple[int, int, str, int]]:
    """(start, stop, kind, unit size) of each declared block; one plain block when none are declared."""
    if not l.blocks:
        return [(0, l.size, "plain", 1)]
    parsed = [parse_block(b) for b in l.blocks]
    plain = sum(n for k, n in parsed if k == "plain")
    units = sum(n * (l.heads.num_heads if k == "q" else l.heads.num_kv_heads) for k, n in parsed if k != "plain")
    head_dim = (l.size - plain) // units if units else 0
    out, offset = [], 0
    for kind, n in parsed:
        length = n if kind == "plain" else n * head_dim * (l.heads.num_heads if kind == "q" else l.heads.num_kv_heads)
        out.append((offset, offset + length, kind, 1 if kind == "plain" else head_dim))
        offset += length
    return out


# --- 3. a column layer against its reader -------------------------------------------------------------


def _compare(c: _Layer, r: _Layer) -> str | None:
    """Why column layer `c` and row layer `r`, which reads its output, disagree; None if they agree."""
    if c.size == r.size:
        if c.partition == r.partition:
            return None
        return (
            f"{c.name} ({c.style}) leaves its {c.size} output features split as {_show(c.partition)}, but "
            f"{r.name} ({r.style}), which reads them, expects {_show(r.partition)}. Give both layers the same "
            "blocks (blocks=('q',) on both for attention heads), or set gather_output=True on the first."
        )
    # Fused outputs: some of the column layer's blocks are what the reader reads (gate|up -> down).
    same = [(a, b) for a, b, *_ in _spans(c) if b - a == r.size]
    if c.blocks and same:
        for a, b in same:
            if _restrict(c.partition, a, b) != r.partition:
                return (
                    f"{c.name} ({c.style}) splits its block [{a}:{b}] as {_show(_restrict(c.partition, a, b))}, "
                    f"but {r.name} ({r.style}), which reads it, expects {_show(r.partition)}. Use the same blocks "
                    "(or heads) on both layers."
                )
        return None
    if c.size % r.size == 0:
        k = c.size // r.size
        if not c.blocks:
            return (
                f"{c.name} has {c.size} output features, {k} times the {r.size} that {r.name} reads: it fuses {k} "
                f"outputs (gate|up, q|k|v), and a plain split would give a device whole blocks instead of a "
                f"slice of each. Say how they are laid out on {c.name}: blocks=({', '.join([str(r.size)] * k)}) "
                f"for {k} blocks one after the other, ('q*{k}',) for {k} pieces per attention head, or "
                f"blocks=({c.size},) if one plain split is really meant."
            )
        # Interleaved: each of the reader's units comes with its k pieces (per-head q|k|v, "q*3").
        scaled = Partition(c.size, tuple(tuple((a * k, b * k) for a, b in rngs) for rngs in r.partition.ranges))
        if c.partition != scaled:
            return (
                f"{c.name} ({c.style}) splits its {c.size} output features as {_show(c.partition)}, which matches "
                f"neither {k} blocks nor {k} interleaved pieces of the {r.size} features {r.name} ({r.style}) "
                f"reads as {_show(r.partition)}. Use blocks that follow the reader's split."
            )
        return None
    # The reader takes a concatenation (its blocks name the column layer's size): those blocks must match.
    mine = [(a, b) for a, b, *_ in _spans(r) if b - a == c.size] if r.blocks else []
    for a, b in mine:
        if _restrict(r.partition, a, b) == c.partition:
            return None
    if mine:
        return (
            f"{r.name} ({r.style}) reads blocks of {c.size} features split as "
            f"{_show(_restrict(r.partition, *mine[0]))}, but {c.name} ({c.style}) produces them as "
            f"{_show(c.partition)}. Use the same blocks on both layers."
        )
    return None  # sizes unrelated (k/v projections read by attention, not by o): nothing to compare


def _restrict(part: Partition, start: int, stop: int) -> Partition:
    """`part` seen only on [start, stop), re-based to 0."""
    ranges = []
    for rngs in part.ranges:
        kept = [(max(a, start) - start, min(b, stop) - start) for a, b in rngs if min(b, stop) > max(a, start)]
        merged: list[tuple[int, int]] = []
        for a, b in kept:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        ranges.append(tuple(merged))
    return Partition(stop - start, tuple(ranges))


# --- 4. split output read whole -----------------------------------------------------------------------


def _check_replicated_reader(c: _Layer, layers: list[_Layer], world: int) -> None:
    sizes = {c.size} | {b - a for a, b, *_ in _spans(c)}  # the whole output, or one of its declared blocks
    later = next((l for l in layers if l.index > c.index and l.role == "replicated" and l.size in sizes), None)
    if later is not None:
        raise ValueError(
            f"{c.name} ({c.style}) leaves its {c.size} output features split over {world} devices, but "
            f"{later.name} ({later.style}, replicated), the next layer that reads {later.size} features, expects "
            f"all of them. Set gather_output=True on {c.name}, or split {later.name} with RowwiseParallel()."
        )
    logger.warning(
        "%s (%s) leaves its output split and no row-parallel layer after it reads it. If it is the model's "
        "output, or feeds code that needs all features, set gather_output=True: a split output whose slices "
        "have equal shapes cannot be told from a whole one at run time.",
        c.name, c.style,
    )


# --- 5. channel-parallel layers read split channels ---------------------------------------------------


def _check_channel_inputs(names: list[str], by_name: dict[str, nn.Module], modules: dict[str, ModuleShard],
                          layers: list[_Layer], scopes: dict[str, tuple[int, int, bool]]) -> None:
    columns = [l for l in layers if l.role == "column"]
    index = {name: i for i, name in enumerate(names)}
    for name, ms in modules.items():
        if not isinstance(ms.style, ChannelParallel):
            continue
        module = by_name[name]
        channels = channel_count(module)
        producer = _nearest(name, index, scopes, [(c.index, c) for c in columns if channels in _sizes(c)])
        where = f"{name or '<root>'} ({ms.style.describe()} on {type(module).__name__})"
        if producer is None:
            whole = _nearest(name, index, scopes, [(i, n) for i, n in enumerate(names) if _out_features(by_name[n]) == channels])
            source = (f"its input comes from {whole} ({type(by_name[whole]).__name__}), which the plan "
                      f"{_why_whole(modules.get(whole))}" if whole is not None else "no layer of the plan leaves them split")
            raise ValueError(
                f"{where} keeps only each device's share of its {channels} channels, so its input must arrive split "
                f"by a column-parallel layer, but {source}: every call would fail. Split the producer column-wise "
                f"(ColwiseParallel() on {whole or 'the layer that produces its input'}, with RowwiseParallel() on the "
                f"layer that reads the norm's output), or drop the ChannelParallel entry for {name or '<root>'} so it "
                "runs whole."
            )
        part = next(iter(ms.splits.values()))[1] if ms.splits else None
        if part is not None and producer.size == channels and part != producer.partition:
            raise ValueError(
                f"{where} splits its {channels} channels as {_show(part)}, but {producer.name} ({producer.style}), "
                f"which produces them, leaves them split as {_show(producer.partition)}. Give the ChannelParallel "
                "entry the producer's blocks (blocks=... as on the column layer)."
            )


def _sizes(c: _Layer) -> set[int]:
    return {c.size} | {b - a for a, b, *_ in _spans(c)}  # the whole output, or one of its declared blocks


def _nearest(name: str, index: dict[str, int], scopes: dict[str, tuple[int, int, bool]], candidates: list):
    """The candidate (module-order index, value) that produces the input of module `name`: in the smallest
    enclosing module that holds one, the last before it, else (outside an nn.Sequential) the first after it."""
    me = index[name]
    parts = name.split(".") if name else []
    for depth in range(len(parts) - 1, -1, -1):
        start, end, sequential = scopes[".".join(parts[:depth])]
        inside = [(i, v) for i, v in candidates if start <= i < end and i != me]
        before = [v for i, v in inside if i < me]
        if before:
            return before[-1]
        after = [v for i, v in inside if i > me]
        if after and not sequential:
            return after[0]
    return None


def _out_features(module: nn.Module) -> int | None:
    kind = layer_kind(module)
    if kind not in (LINEAR, CONV1D_HF, CONV):
        return None
    return weight_shape(module)[kind.weight_out_dim]


def _why_whole(ms: ModuleShard | None) -> str:
    if ms is None or not ms.splits:
        return "leaves whole (no plan entry splits it)"
    if isinstance(ms.style, ColwiseParallel) and ms.style.gather_output:
        return "gathers whole (gather_output=True)"
    return f"splits with {ms.style.describe()}, whose output is whole"


# --- 6. head counts read by a forward without a Heads entry --------------------------------------------

_HEAD_COUNT = re.compile(r"^(n|num)_?(attention_)?heads?$", re.IGNORECASE)


def _check_head_counts(by_name: dict[str, nn.Module], modules: dict[str, ModuleShard], layers: list[_Layer]) -> None:
    children: dict[str, list[_Layer]] = {}
    for l in layers:
        if l.role == "column" and l.heads is None and l.name:
            children.setdefault(l.name.rpartition(".")[0], []).append(l)
    for parent, split in children.items():
        if parent in modules:  # an entry of its own (PerDeviceValues, ...) sets what each device holds
            continue
        module = by_name[parent]
        counts = {a: v for a, v in vars(module).items()
                  if _HEAD_COUNT.match(a) and isinstance(v, int) and not isinstance(v, bool) and v > 1}
        if not counts:
            continue
        tree = _source_tree(type(module), "forward")
        read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name) and node.value.id == "self"} if tree is not None else set()
        for attr, count in counts.items():
            cut = [l for l in split if l.size % count == 0]
            if attr not in read or not cut:
                continue
            raise ValueError(
                f"{parent or '<root>'} ({type(module).__name__}) reads self.{attr} = {count} in its forward, but the plan "
                f"splits {', '.join(l.name for l in cut)} column-wise with no Heads entry: every device would keep "
                f"{attr} = {count} while holding fewer heads, and the reshape by heads fails. Add "
                f"{parent or '<root>'!r}: tp.Heads(num_heads={count}, attrs={{{attr!r}: 'heads'}}) to the plan "
                "(num_kv_heads= too for grouped keys and values), and blocks=('q',) (('kv',) for k and v) on the "
                "projections, as docs/plans.md shows."
            )


def _show(part: Partition) -> str:
    """'[0:40] | [40:72]': each device's ranges, devices separated by '|'."""
    return " | ".join(",".join(f"{a}:{b}" for a, b in rngs).join("[]") for rngs in part.ranges)
