"""A given plan checked against one traced forward pass, with the analysis that infers plans.

A column-parallel layer that leaves its output split (``ColwiseParallel()`` without ``gather_output``) hands
each device a slice of its output features; the split is right only if everything those features meet before
the row-parallel layer that reads them keeps each device's features apart. plans/validate.py compares the
two layers' layouts without running anything; this module runs the model once (trace.py, with only the
plan's own column layers as columns) and checks what happens between them:

1. no op mixes features that the plan puts on different devices: a softmax or a norm over the split
   features, a reshape that makes heads out of several devices' features, a sum over them. Every unit of
   the trace (features.py: what must stay together) lies on one device, and a query unit finds the
   key/value unit it needs (grouped heads) on its own device;
2. nothing reads them in a way a split model cannot reproduce: an op without an inference rule (a custom
   op), a read on the host, the model's output, a layer the plan keeps whole (the trace's *poisons*);
3. each row-parallel layer reading them reads, on every device, features that device holds;
4. a channel-wise layer they pass through (BatchNorm, GroupNorm, a depthwise conv) has a ChannelParallel
   entry, and a column-parallel layer does not read another one's split output.

`keep_whole(module, plan, world_size, check=...)` is what `resolve_plan` calls for a plan the user gave:
with ``check=None`` a problem refuses the plan (ValueError naming the module path, the op and the fix)
before the model changes; with ``check=True`` each failing column/row pair stays whole (one warning each)
and the numerical self-check (selfcheck.py) then compares the rest. ``check=False`` skips both.

A model the trace cannot run (it needs inputs no synthetic guess provides) is not refused for that alone:
a warning says the plan was not verified and the plan is used as given. Left to check=True's numbers too:
attention heads next to per-head inputs the plan slices itself (ALiBi, T5's position bias), whether a
whole activation meeting split features gets its whole gradient, and models with PEFT adapters.

Cost: one forward pass on a tiny input, int64 shadows of the same size, and the plan's dry run
(plans/sharding.py), which the engine repeats. A model with more than 256 MiB of weights is traced as an
empty copy on the meta device (no weight read, no memory; see `plan_problems`).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..logs import get_logger
from ..layers import CONV, CONV1D_HF, LINEAR, layer_kind, weight_shape
from ..partition import Partition
from ..plans.plan import Plan, escape
from ..plans.sharding import ShardedModel, shard_plan
from ..plans.validate import column_readers
from ..styles import ChannelParallel, ColwiseParallel, Replicate, RowwiseParallel, ShardParams
from ..styles.attention_heads import AttentionHeads
from ..styles.heads import Heads
from ..styles.per_device import PerDeviceValues
from .evidence import Trace
from .features import FeatureSet, Ids, compact
from .groups import row_labels
from .inputs import as_inputs, input_candidates
from .trace import trace_model

logger = get_logger(__name__)

_SPLIT_LAYERS = (LINEAR, CONV1D_HF, CONV)
MAX_DEVICES = 62  # device sets are int64 bit masks


@dataclass
class PairProblem:
    """Why a column layer's split output cannot reach its readers as the plan splits it."""

    column: str
    rows: list[str]
    what: str  # the op (or read) and the module it happens in
    fix: str = ""

    def names(self) -> list[str]:
        return [self.column] + [r for r in self.rows if r != self.column]

    def line(self) -> str:
        pair = " and ".join(repr(n) for n in self.names())
        return f"{pair}: {self.what}"


class PlanRefused(ValueError):
    """A given plan splits a column/row pair around something that is not element-wise."""


def keep_whole(module: nn.Module, plan: Plan, world_size: int, *, check: bool | None = None) -> dict[str, Replicate]:
    """Nothing when every column/row pair of `plan` passes (see the module docstring); else refuse the plan
    (check=None), or return ``Replicate()`` entries for the failing pairs (check=True), for ``plan | entries``."""
    if check is False or world_size < 2:
        return {}
    validate = get_logger("tensorshard.plans.validate")
    level = validate.level
    validate.setLevel(logging.ERROR)  # its warnings come once, from the engine's own dry run
    try:
        sharded = shard_plan(module, plan, world_size)
    except (ValueError, TypeError, NotImplementedError):
        return {}  # the engine's own dry run raises the same error, with its fix
    finally:
        validate.setLevel(level)
    if world_size > MAX_DEVICES or not _columns(module, sharded):
        return {}
    if any(getattr(ms.style, "torchrun_only", False) for ms in sharded.modules.values()):
        # Sequence parallelism and a vocabulary-parallel head leave activations split between layers on purpose
        # (as DTensors whose layout says so); this analysis knows only whole activations between pairs.
        logger.debug("plan check skipped: the plan uses styles that keep activations split between layers")
        return {}
    try:
        problems = plan_problems(module, sharded)
    except Exception as e:  # noqa: BLE001 - a model the trace cannot run is not refused for that alone
        logger.warning(
            "could not verify the plan's column/row pairs on %s: its forward did not run on a synthetic input "
            "(%s: %s). The plan is used as given; split with check=False to skip this check, or check that "
            "nothing between a ColwiseParallel layer and its RowwiseParallel partner mixes features.",
            type(module).__name__, type(e).__name__, str(e).splitlines()[0] if str(e) else "",
        )
        return {}
    if not problems:
        return {}
    if check is None:
        raise PlanRefused(_refusal(problems, world_size))
    whole: dict[str, Replicate] = {}
    for p in problems:
        logger.warning("kept whole (plan check): %s", p.line())
        whole.update({escape(n): Replicate() for n in p.names()})
    return whole


def plan_problems(module: nn.Module, sharded: ShardedModel, inputs=None) -> list[PairProblem]:
    """Every failing pair of the plan `sharded` was built from, one problem per column layer.

    A model holding more than `META_TRACE_BYTES` of weights is traced as an empty copy on the meta device
    (no weight is read, nothing is computed but shapes and the trace's bookkeeping); when that copy cannot run (its forward reads weight values, a quantized layer), the model itself is traced."""
    if inputs is None and _weight_bytes(module) > META_TRACE_BYTES:
        skeleton = _meta_copy(module)
        if skeleton is not None:
            try:
                return _plan_problems(skeleton, sharded, None)
            except Exception as e:  # noqa: BLE001 - fall back to the model itself
                logger.debug("the meta-device copy of %s did not trace (%s); tracing the model", type(module).__name__, e)
    return _plan_problems(module, sharded, inputs)


META_TRACE_BYTES = 256 * 2**20


def _weight_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.parameters() if not t.is_meta)


def _meta_copy(module: nn.Module) -> nn.Module | None:
    """`module`'s tree with every parameter and buffer an empty meta tensor of its shape, or None."""
    memo: dict[int, object] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    try:
        return copy.deepcopy(module, memo)
    except Exception:  # noqa: BLE001 - a module that cannot be copied is traced as it is
        return None


def _plan_problems(module: nn.Module, sharded: ShardedModel, inputs) -> list[PairProblem]:
    columns = _columns(module, sharded)
    rows = _rows(module, sharded)
    layers = {n for n, m in module.named_modules() if layer_kind(m) is not None}
    fixed = {n for n in layers if n not in columns and n not in rows and not (sharded.modules.get(n) and sharded.modules[n].splits)}
    attempt = lambda x: trace_model(module, x, fixed=fixed, capture=False, columns=set(columns), log=True)  # noqa: E731
    if inputs is not None:
        return _problems(module, sharded, attempt(as_inputs(inputs)), columns, rows)
    # The synthetic input is a guess (inputs.py): a plan is refused only if every guess that runs shows a
    # problem (a BatchNorm1d reads (batch, features), but also runs on (batch, 16, features), wrongly).
    first: list[PairProblem] | None = None
    error = None
    for candidate in input_candidates(module):
        try:
            trace = attempt(candidate)
        except Exception as e:  # noqa: BLE001 - the next guess may run
            error = error or e
            continue
        problems = _problems(module, sharded, trace, columns, rows)
        if not problems:
            return []
        first = first if first is not None else problems
    if first is None:
        raise error
    return first


# --- what the plan splits -------------------------------------------------------------------------------


def _columns(module: nn.Module, sharded: ShardedModel) -> dict[str, Partition]:
    """Layers whose output the plan leaves split -> how their output features are split."""
    out = {}
    for name, ms in sharded.modules.items():
        if isinstance(ms.style, ColwiseParallel) and not ms.style.gather_output and "weight" in ms.splits:
            part = _feature_split(module.get_submodule(name), ms.splits["weight"][1], out=True)
            if part is not None:
                out[name] = part
    return out


def _rows(module: nn.Module, sharded: ShardedModel) -> dict[str, Partition]:
    out = {}
    for name, ms in sharded.modules.items():
        if isinstance(ms.style, RowwiseParallel) and "weight" in ms.splits:
            part = _feature_split(module.get_submodule(name), ms.splits["weight"][1], out=False)
            if part is not None:
                out[name] = part
    return out


def _feature_split(layer: nn.Module, part: Partition, out: bool) -> Partition | None:
    kind = layer_kind(layer)
    if kind not in _SPLIT_LAYERS:
        return None
    size = weight_shape(layer)[kind.weight_out_dim if out else kind.weight_in_dim]
    if kind is CONV and not out:
        size *= layer.groups
    return part if part.size == size else None


# --- the checks -----------------------------------------------------------------------------------------


def _problems(module: nn.Module, sharded: ShardedModel, trace: Trace, columns: dict[str, Partition],
              rows: dict[str, Partition]) -> list[PairProblem]:
    fs = trace.fs
    holders = torch.zeros(fs.size, dtype=torch.long)  # bit r: device r holds the feature
    owner = torch.full((fs.size,), -1, dtype=torch.long)  # which column made it (index into names)
    names = [n for n in columns if trace.layers.get(n) is not None and trace.layers[n].out_ids is not None]
    for i, name in enumerate(names):
        ids = trace.layers[name].out_ids
        owner[ids] = i
        for r, ranges in enumerate(columns[name].ranges):
            for a, b in ranges:
                holders[ids[a:b]] |= 1 << r
    every = torch.arange(fs.size)
    roots = fs.find(every) if fs.size else every
    lo = torch.full((fs.size,), 1 << 62, dtype=torch.long).scatter_reduce(0, roots, holders, "amin")
    hi = torch.zeros(fs.size, dtype=torch.long).scatter_reduce(0, roots, holders, "amax")
    readers = column_readers(module, sharded.modules, sharded.world_size)
    problems: dict[str, PairProblem] = {}

    def report(column: str, what: str, fix: str, partners: list[str] | None = None) -> None:
        if column not in problems:
            found = partners if partners is not None else _partners(trace, column, rows)
            if not found and readers.get(column):
                found = [readers[column]]
            problems[column] = PairProblem(column, found, what, fix)

    for name in columns:  # 4b: a column reading another column's split output
        info = trace.layers.get(name)
        if info is not None and "row" in info.roles:
            source = _source_of(trace, info, owner, names)
            report(name, f"it is column-parallel but reads the split output of {source} (no row-parallel layer "
                   "in between), so each device would multiply a slice by the whole weight",
                   f"make {name!r} RowwiseParallel() as the partner of {source!r}, or gather {source!r} "
                   "(gather_output=True)", partners=[source] if source else [])
    sliced = _sliced_per_head(sharded)
    # each device reads its own count there: a Heads entry's attrs, or per-device values (compat's attribute rules)
    heads = [n for n, ms in sharded.modules.items() if isinstance(ms.style, (Heads, PerDeviceValues))]
    for i, name in enumerate(names):
        if sliced and sharded.modules[name].heads is not None:
            continue  # its heads meet per-head inputs the plan slices itself (see _sliced_per_head)
        classes = torch.unique(roots[trace.layers[name].out_ids])
        poison = _poison_of(trace, roots, classes)
        if poison is not None:  # 2
            if poison.kind == "output":
                report(name, f"its split output reaches the model's output (in {poison.where}), which would "
                       "hold one device's slice", f"set gather_output=True on {name!r}")
            else:
                report(name, f"in {_module(module, poison.where)}, {_op(poison.reason)}: a split model cannot "
                       "compute that from each device's slice", _fix(name, readers.get(name)))
            continue
        mixed = classes[lo[classes] != hi[classes]]
        if mixed.numel():  # 1
            op = _culprit(fs, holders, roots, int(mixed[0]))
            report(name, f"{_module(module, op)} combines output features of {name} that the plan puts on "
                   f"different devices ({_show(columns[name])}), before its row-parallel partner reads them",
                   _fix(name, readers.get(name)))
            continue
        fixed = _fixed_count(trace, roots, classes, heads)
        if fixed is not None:  # 1: heads made with the model's whole head count
            local = ", ".join(str(columns[name].local_size(r)) for r in range(sharded.world_size))
            report(name, f"in {_module(module, fixed.where)}, {fixed.op} reshapes the split output features of "
                   f"{name} into {fixed.count} heads of {fixed.head_dim}: the model's whole head count, while each "
                   f"device holds only its own heads' features ({local} of {columns[name].size}), so the first call "
                   "fails in the model's own code",
                   f"add a tp.Heads(num_heads={fixed.count}, attrs={{'<head count attribute>': 'heads'}}) entry for "
                   f"{fixed.where!r} so each device reads its own head count, or reshape with -1 for the heads "
                   f"(view(..., -1, {fixed.head_dim}))")
    needer, needed = fs.needs()  # 1: grouped key/value heads
    for a, b in zip(needer.tolist(), needed.tolist()):
        if lo[a] == hi[a] and lo[b] == hi[b] and lo[a] & ~lo[b] and int(owner[a]) >= 0:
            name = names[int(owner[a])]
            report(name, f"query features of {name} on some device read key/value features of "
                   f"{names[int(owner[b])] if int(owner[b]) >= 0 else 'another layer'} that the plan puts elsewhere",
                   "describe the attention with a tp.Heads entry on the module holding q, k and v (num_heads, "
                   "num_kv_heads) and blocks=('q',) / ('kv',) on its projections")
    for name, part in rows.items():  # 3
        info = trace.layers.get(name)
        for call in (info.calls if info is not None else []):
            if call.role != "row" or call.row_ids is None:
                continue
            labels = row_labels(fs, call.row_ids, info.kind.feature_dim)
            if labels is None:
                source = _source_of(trace, info, owner, names)
                if source and source not in problems:
                    report(source, f"{name} reads its split features mixed with whole values or along other "
                           "dimensions than its input features", _fix(source, name))
                continue
            for r, ranges in enumerate(part.ranges):
                for a, b in ranges:
                    held = (lo[labels[a:b]] >> r) & 1
                    source = _source_of(trace, info, owner, names) if bool((held == 0).any()) else ""
                    if source and source not in problems:
                        report(source, f"{name} (RowwiseParallel) reads, on device {r}, features that "
                               f"{source} puts on another device ({_show(columns[source])} against "
                               f"{_show(part)})", "give both layers the same blocks (and a tp.Heads entry for "
                               "attention heads)", partners=[name])
    for name in trace.channels:  # 4a
        ms = sharded.modules.get(name)
        if ms is None or not isinstance(ms.style, ChannelParallel):
            source = _source_of_ids(fs, trace.channels[name], owner, names)
            if source and source not in problems:
                report(source, f"{name} ({type(module.get_submodule(name)).__name__}) normalises the channels "
                       f"{source} splits, but the plan runs it whole, so it would get a slice of its channels",
                       f"add {name!r}: tp.ChannelParallel() to the plan")
    return list(problems.values())


@dataclass
class _FixedCountFound:
    op: str
    where: str
    count: int
    head_dim: int


def _fixed_count(trace: Trace, roots: Ids, classes: Ids, heads: list[str]) -> _FixedCountFound | None:
    """The first reshape of features in `classes` into heads by an explicit count (head_counts.py) that no Heads
    entry or per-device values cover (either gives each device its own count)."""
    for found in trace.fixed_counts:
        if any(found.where == h or found.where.startswith(h + ".") or not h for h in heads):
            continue
        if found.count_ids is not None and bool(torch.isin(roots[found.count_ids], classes).any()):
            continue  # counted from the size of split features: each device counts its own heads
        if bool(torch.isin(roots[found.ids], classes).any()):
            shape = ", ".join(str(s) for s in found.shape)
            return _FixedCountFound(f"view({shape})", found.where, found.count, found.head_dim)
    return None


def _sliced_per_head(sharded: ShardedModel) -> bool:
    """The plan slices per-head tensors that the trace sees whole: ALiBi slopes (AttentionHeads' head_inputs),
    T5's position bias (ShardParams with a split output on its embedding). Their values vary along the heads,
    so the trace would join every head into one unit; attention split by such a plan's Heads entries is left
    to check=True's numerical comparison."""
    for ms in sharded.modules.values():
        if isinstance(ms.style, AttentionHeads) and ms.style.head_inputs:
            return True
        if isinstance(ms.style, ShardParams) and ms.style.output == "split":
            return True
    return False


def _poison_of(trace: Trace, roots: Ids, classes: Ids):
    """The first poison that touches `classes` (one not about the model's output, if any). A whole activation
    meeting split features without varying along them (T5's position bias, under a Heads entry that slices
    it per device) computes the right forward; whether its gradient is whole is left to check=True's
    numerical comparison."""
    if not trace.poisons or not classes.numel():
        return None
    hit = [p for p in trace.poisons if p.kind != "gradient" and bool(torch.isin(roots[p.ids], classes).any())]
    return next((p for p in hit if p.kind != "output"), hit[0] if hit else None)


def _culprit(fs: FeatureSet, holders: Ids, roots: Ids, root: int) -> str:
    """The op that first joined features held by different devices into the class `root`: replay the
    trace's unions (FeatureSet.log) on the class's members until a class spans two device sets."""
    members = (roots == root).nonzero().squeeze(1)
    inside = torch.zeros(fs.size, dtype=torch.bool)
    inside[members] = True
    replay = FeatureSet()
    replay.new(fs.size)
    for op, a, b in fs.log or []:
        keep = inside[a] & inside[b]
        if not bool(keep.any()):
            continue
        replay.union(a[keep], b[keep])
        r = replay.find(members)
        lo = torch.full((fs.size,), 1 << 62, dtype=torch.long).scatter_reduce(0, r, holders[members], "amin")
        hi = torch.zeros(fs.size, dtype=torch.long).scatter_reduce(0, r, holders[members], "amax")
        if bool((lo[r] != hi[r]).any()):
            return op
    return "an op"


def _partners(trace: Trace, column: str, rows: dict[str, Partition]) -> list[str]:
    """The plan's row layers that read features of `column` in the trace."""
    fs = trace.fs
    mine = fs.classes(trace.layers[column].out_ids)
    found = []
    for name in rows:
        info = trace.layers.get(name)
        ids = [c.row_ids for c in (info.calls if info else []) if c.role == "row" and c.row_ids is not None]
        if ids and bool(torch.isin(fs.classes(torch.cat([i.reshape(-1) for i in ids])), mine).any()):
            found.append(name)
    return found


def _source_of(trace: Trace, info, owner: Ids, names: list[str]) -> str:
    ids = [c.row_ids for c in info.calls if c.role == "row" and c.row_ids is not None]
    return _source_of_ids(trace.fs, torch.cat([i.reshape(-1) for i in ids]), owner, names) if ids else ""


def _source_of_ids(fs: FeatureSet, ids: Ids, owner: Ids, names: list[str]) -> str:
    flat = compact(ids).reshape(-1)
    flat = flat[flat >= 0]
    made = owner[flat]
    made = made[made >= 0]
    return names[int(made[0])] if made.numel() else ""


def _op(reason: str) -> str:
    return reason[0].lower() + reason[1:] if reason else "an op"


def _module(module: nn.Module, where: str) -> str:
    """'softmax in 1' -> 'softmax in 1 (Softmax)': the module path with its class."""
    head, sep, path = where.rpartition(" in ")
    path = path if sep else where
    try:
        kind = type(module.get_submodule("" if path == "<model>" else path)).__name__
    except AttributeError:
        return where
    return f"{where} ({kind})"


def _fix(column: str, row: str | None) -> str:
    pair = f"{column!r} and {row!r}" if row else repr(column)
    return (f"leave {pair} whole (remove their entries), split only where nothing but element-wise ops "
            f"(activations, gate * up, dropout) sits between the column and the row layer, or set "
            f"gather_output=True on {column!r}")


def _show(part: Partition) -> str:
    return " | ".join(",".join(f"{a}:{b}" for a, b in rngs).join("[]") for rngs in part.ranges)


def _refusal(problems: list[PairProblem], world_size: int) -> str:
    first = problems[0]
    more = "".join(f"\n  - {p.line()}" for p in problems[1:6])
    if len(problems) > 6:
        more += f"\n  - ... and {len(problems) - 6} more"
    return (
        f"the plan splits {first.line()}. Over {world_size} devices this gives wrong numbers or fails at the "
        f"first call. Fix: {first.fix}. Or split with check=True to keep each such pair whole automatically "
        f"(check=False skips this check){' Other pairs:' + more if more else ''}"
    )
