"""Plan inference: a plan for a model nobody wrote one for, read from how its features flow.

    plan = tp.infer_plan(model, world_size=4)           # a Plan like a hand-written one
    report = tp.plans.infer.infer(model, 4, check=True)  # the plan, its groups and every fallback

1. Trace (trace.py): one forward pass on a tiny synthetic input records, per column candidate, which
   features must stay together (units), which rows consume them, and what poisons them.
2. Group: columns and rows that share units form a group (an attention, an MLP, the output head).
3. Decide per group: a column -> row group whose units lay out as blocks (structure.py) is split, with a
   Heads entry on its smallest enclosing module when its units are heads; a lone column whose features
   only reach the model's output and which widens its input (the vocabulary head) gathers its output; the
   embedding the model's input ids go to is split by vocabulary. Everything else stays whole, and each
   such fallback is logged once with its reason.
4. A group that falls back frees its rows to pair with later layers: trace again with its columns fixed,
   until nothing changes. With ``check=True`` every split group is then verified numerically in
   isolation (selfcheck.py); a mismatch is one more fallback.

The communication this reaches is a hand-written plan's: per transformer block one all-reduce forward
after attention and one after the MLP, and one backward for each (q, k, v read one tensor).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..engines.sharding import shard_plan
from ..layers import EMBEDDING
from ..styles import ColwiseParallel, EmbeddingParallel, Heads, RowwiseParallel, Style, SumGrads
from .plan import Plan, match_pattern
from .structure import Layout, LayoutError, head_attrs, infer_layout
from .trace import Poison, Trace, as_inputs, input_candidates, trace_model

logger = logging.getLogger(__name__)

MAX_ROUNDS = 8


@dataclass
class Group:
    """Columns and the rows that read their features; what the plan does with them and why."""

    columns: list[str]
    rows: list[str]
    poisons: list[Poison] = field(default_factory=list)
    syncs: set[tuple[str, str]] = field(default_factory=set)  # whole parameters read by its split features
    outcome: str = "whole"  # "split" | "gather" | "whole"
    reason: str = ""
    owner: str | None = None  # the module that gets the Heads entry
    layout: Layout | None = None
    entries: dict[str, Style] = field(default_factory=dict)

    @property
    def layers(self) -> list[str]:
        return self.columns + self.rows

    def fail(self, reason: str) -> "Group":
        self.outcome, self.reason, self.entries = "whole", reason, {}
        return self

    def describe(self) -> str:
        if self.layout is not None and self.layout.heads:
            kv = f", {self.layout.num_kv_heads} KV" if self.layout.num_kv_heads != self.layout.num_heads else ""
            return f"attention ({self.layout.num_heads} heads{kv})"
        if self.outcome == "gather":
            return "output head"
        return "column -> row pair" if self.rows else "column"


@dataclass
class Fallback:
    layers: list[str]
    reason: str
    stage: str  # "structure" or "self-check"

    def line(self) -> str:
        return f"kept whole ({self.stage}): {_short(self.layers)}: {self.reason}"


@dataclass
class Inference:
    """The result of `infer`: the plan and how it came about."""

    plan: Plan
    groups: list[Group]
    embeddings: dict[str, Style]
    fallbacks: list[Fallback]
    trace: Trace
    rounds: int
    checked: int = 0


def infer_plan(
    module: nn.Module, world_size: int, *, example_inputs: Any = None, check: bool = False
) -> Plan:
    """A plan for `module` over `world_size` devices, inferred from its structure (see module docstring).

    Args:
        example_inputs: what to run the model on (a tensor, a tuple of args or a dict of kwargs);
            default: ``input_ids`` for a transformers model, else a tiny input shaped for its first layer.
        check: verify every split group numerically on a copy of its module, keeping the ones that fail
            whole (see selfcheck.py for the memory it needs).
    """
    return infer(module, world_size, example_inputs=example_inputs, check=check).plan


def infer(module: nn.Module, world_size: int, *, example_inputs: Any = None, check: bool = False) -> Inference:
    """`infer_plan` with the full report: groups, fallbacks and the last trace."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"plan inference reads an nn.Module; got {type(module).__name__}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    _PARTNERS.clear()
    try:
        return _infer(module, world_size, example_inputs, check)
    finally:
        _PARTNERS.clear()  # holds the model


def _infer(module: nn.Module, world_size: int, example_inputs: Any, check: bool) -> Inference:
    inputs = as_inputs(example_inputs) if example_inputs is not None else _first_input_that_runs(module)
    fixed: dict[str, str] = {}
    fallbacks: list[Fallback] = []
    verdicts: dict = {}  # self-check results by region structure and entries
    checked = 0
    for rounds in range(1, MAX_ROUNDS + 1):
        trace = _run(module, inputs, fixed, capture=check)
        groups = find_groups(trace)
        for g in groups:
            decide(g, trace, module, world_size)
        embeddings = decide_embeddings(trace, module, world_size, fixed)
        _resolve_ties(module, groups, embeddings)
        retrace = _record_failures(groups, trace, fixed, fallbacks, "structure")
        if not retrace and check:
            from .selfcheck import check_entries

            for g in groups:
                if g.outcome != "whole":
                    checked += 1
                    verdict = check_entries(module, trace, g.entries, world_size, verdicts)
                    if verdict is not None:
                        g.fail(f"self-check: {verdict}")
            for name, style in list(embeddings.items()):
                checked += 1
                verdict = check_entries(module, trace, {name: style}, world_size, verdicts)
                if verdict is not None:
                    del embeddings[name]
                    fixed[name] = verdict
                    fallbacks.append(Fallback([name], f"self-check: {verdict}", "self-check"))
            _resolve_ties(module, groups, embeddings)
            retrace = _record_failures(groups, trace, fixed, fallbacks, "self-check")
        if not retrace:
            break
    plan = assemble(module, groups, embeddings)
    result = Inference(plan, groups, embeddings, fallbacks, trace, rounds, checked)
    _log_summary(module, world_size, result)
    return result


def _first_input_that_runs(module: nn.Module):
    """The first synthetic input the model runs on (see `input_candidates`), or the error of the first."""
    candidates = list(input_candidates(module))
    if len(candidates) == 1:
        return candidates[0]  # nothing to choose: the traced pass itself reports a failure
    first_error = None
    for inputs in candidates:
        try:
            trace_model(module, inputs, capture=False)
            return inputs
        except Exception as e:
            first_error = first_error or e
    _run(module, next(iter(input_candidates(module))), {}, False)  # raises, with the first guess's error
    raise first_error  # pragma: no cover


def _run(module: nn.Module, inputs, fixed: dict[str, str], capture: bool) -> Trace:
    try:
        return trace_model(module, inputs, fixed=set(fixed), capture=capture)
    except Exception as e:
        raise RuntimeError(
            f"plan inference could not run {type(module).__name__} on its example input ({type(e).__name__}: {e}). "
            "Pass one it accepts: tp.tensor_parallel(model, devices, plan=tp.infer_plan(model, len(devices), "
            "example_inputs=(x,))), or write a plan."
        ) from e


# --- groups ---------------------------------------------------------------------------------------------


def find_groups(trace: Trace) -> list[Group]:
    """Columns and rows that share feature classes (or grouped-KV needs), in call order."""
    fs = trace.fs
    fs.merge_co_needed()
    names: list[str] = []
    ids_of: list[torch.Tensor] = []
    for name, info in trace.layers.items():
        ids = [info.out_ids] if info.out_ids is not None else []
        ids += [c.row_ids.reshape(-1) for c in info.calls if c.role == "row" and c.row_ids is not None]
        if ids:
            names.append(name)
            ids_of.append(fs.classes(torch.cat([i.reshape(-1) for i in ids])))
    # Vectorised: every class points at the first layer holding it; layers meeting that way are joined.
    roots = torch.cat(ids_of) if ids_of else torch.empty(0, dtype=torch.long)
    layer = torch.cat([torch.full((len(r),), i, dtype=torch.long) for i, r in enumerate(ids_of)]) if ids_of else roots
    owner = torch.full((fs.size,), len(names), dtype=torch.long)
    owner.scatter_reduce_(0, roots, layer, reduce="amin")
    parent = list(range(len(names)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    first = owner[roots]
    meets = first != layer  # a class also held by an earlier layer
    for a, b in [
        divmod(x, len(names) + 1) for x in torch.unique(layer[meets] * (len(names) + 1) + first[meets]).tolist()
    ]:
        join(a, b)
    needer, needed = fs.needs()
    if needer.numel():
        for a, b in torch.unique(torch.stack([owner[needer], owner[needed]], 1), dim=0).tolist():
            if a < len(names) and b < len(names):
                join(a, b)
    order = {n: i for i, n in enumerate(trace.call_order)}
    members: dict[int, list[str]] = {}
    for i in sorted(range(len(names)), key=lambda i: order.get(names[i], len(order))):
        members.setdefault(find(i), []).append(names[i])
    groups: dict[int, Group] = {}
    for r, group_names in members.items():
        cols = [n for n in group_names if trace.layers[n].out_ids is not None]
        groups[r] = Group(cols, [n for n in group_names if n not in cols])

    def groups_of(ids: torch.Tensor) -> set[int]:
        held = owner[fs.classes(ids)]
        return {find(i) for i in torch.unique(held[held < len(names)]).tolist()}

    for p in trace.poisons:
        for r in groups_of(p.ids):
            if all(p is not q for q in groups[r].poisons):
                groups[r].poisons.append(p)
    for s in trace.syncs:
        for r in groups_of(s.ids):
            groups[r].syncs.update(s.params)
    return list(groups.values())


def decide(g: Group, trace: Trace, module: nn.Module, world_size: int) -> Group:
    """Choose split / gather / whole for one group, with its plan entries."""
    layers = trace.layers
    for name in g.layers:
        info = layers[name]
        if len(info.roles) > 1:
            return g.fail(f"{name} is called in different roles ({', '.join(sorted(info.roles))})")
        if info.foreign:
            return g.fail(f"the weights of {name} are also used outside its forward ({info.foreign[0]})")
    if g.poisons:
        if not g.rows and len(g.columns) == 1 and all(p.kind == "output" for p in g.poisons):
            return _gather(g, layers[g.columns[0]], world_size, module, trace)
        p = next((p for p in g.poisons if p.kind != "output"), g.poisons[0])
        return g.fail(f"{p.reason} (in {p.where})")
    if not g.rows:
        return g.fail("no layer consumes its output features")
    fs = trace.fs
    labels: dict[str, torch.Tensor] = {name: fs.find(layers[name].out_ids) for name in g.columns}
    for name in g.rows:
        info = layers[name]
        seen = None
        for call in info.calls:
            lab = _row_labels(fs, call.row_ids, info.kind.feature_dim)
            if lab is None:
                return g.fail(f"{name} reads split features that also vary along other dimensions, or mixed with whole ones")
            if seen is not None and not torch.equal(lab, seen):
                return g.fail(f"{name} is called on different features in different calls")
            seen = lab
        labels[name] = seen
    units = set(fs.distinct(torch.cat(list(labels.values()))).tolist())
    needer, needed = fs.needs()
    needs: dict[int, set[int]] = {}
    for a, b in zip(needer.tolist(), needed.tolist()):
        if a in units and b in units:
            needs.setdefault(a, set()).add(b)
    kv_side = {name: fs.kv_side[layers[name].out_ids] for name in g.columns}
    try:
        layout = infer_layout(labels, needs, kv_side)
    except LayoutError as e:
        return g.fail(str(e))
    g.layout = layout
    entries: dict[str, Style] = {}
    if layout.heads:
        g.owner = _common_parent(g.layers)
        owner = module.get_submodule(g.owner)
        attrs = head_attrs(owner, layout, world_size)
        needs_dim = any(q in ("features", "kv_features") for q in attrs.values())
        entries[g.owner] = Heads(
            num_heads=layout.num_heads,
            num_kv_heads=layout.num_kv_heads if layout.kv_blocks else None,
            head_dim=layout.head_dim if needs_dim else None,
            attrs=attrs,
        )
    for name in g.columns:
        entries[name] = ColwiseParallel(blocks=_blocks(layout.blocks[name], layers[name]))
    for name in g.rows:
        entries[name] = RowwiseParallel(blocks=_blocks(layout.blocks[name], layers[name], row=True))
    problem = _validate(module, entries, world_size)
    if problem:
        return g.fail(problem)
    for owner_name, pname in sorted(g.syncs):
        if owner_name in entries and not isinstance(entries[owner_name], SumGrads) or owner_name in g.layers:
            return g.fail(
                f"{owner_name}.{pname} is read by the split features but {owner_name} is split itself; "
                "its gradient cannot be summed (write a plan with ShardParams for it)"
            )
        entries[owner_name] = SumGrads()
    g.outcome, g.entries = "split", entries
    return g


def _gather(g: Group, info, world_size: int, module: nn.Module, trace: Trace) -> Group:
    """The output head: a lone column whose features reach the model's output, as wide as the vocabulary
    of the embedding the input ids go to. Split by output features, its logits gathered."""
    w = info.module.weight
    out_f = w.shape[info.kind.weight_out_dim]
    vocabularies = {
        other.module.num_embeddings for other in trace.layers.values() if other.kind is EMBEDDING and other.reads_model_input
    }
    if out_f not in vocabularies:
        return g.fail(f"its output reaches the model's output and is not a vocabulary ({out_f} features): not worth a gather")
    entries = {info.name: ColwiseParallel(gather_output=True)}
    problem = _validate(module, entries, world_size)
    if problem:
        return g.fail(problem)
    g.outcome, g.entries = "gather", entries
    return g


def _row_labels(fs, ids: torch.Tensor, feature_dim: int) -> torch.Tensor | None:
    """The class of each input feature of a row call, or None when the split is not on features alone."""
    if ids is None or not bool((ids >= 0).all()):
        return None
    classes = fs.find(ids)
    fdim = feature_dim % ids.dim()
    first = classes.movedim(fdim, -1).reshape(-1, classes.shape[fdim])
    if not bool((first == first[:1]).all()):
        return None
    return first[0]


def _blocks(blocks: tuple, info, row: bool = False) -> tuple | None:
    w = info.module.weight
    size = w.shape[info.kind.weight_in_dim if row else info.kind.weight_out_dim]
    if len(blocks) == 1 and blocks[0] == size:
        return None
    return tuple(blocks)


def _validate(module: nn.Module, entries: dict[str, Style], world_size: int) -> str | None:
    """Dry-run the entries (head grouping, block sizes against the device count); the error, if any.

    Modules that share a weight with an entry (a tied embedding and head) get the style that splits it
    alike for the dry run; whether they really do is settled for the whole plan (`_resolve_ties`)."""
    trial = dict(entries)
    partners = _tied_partners(module)
    for name in entries:
        for partner in partners.get(name, ()):
            if partner not in trial:
                is_embedding = isinstance(module.get_submodule(partner), (nn.Embedding, nn.EmbeddingBag))
                trial[partner] = EmbeddingParallel() if is_embedding else ColwiseParallel(gather_output=True)
    root = _common_parent(list(trial)) if len(trial) > 1 else ""
    scope = module.get_submodule(root)  # only the subtree that holds the entries: fast on deep models
    local = {(k[len(root) + 1 :] if root else k) if k != root else "": v for k, v in trial.items()}
    try:
        shard_plan(scope, Plan({_escape(k): v for k, v in local.items()}), world_size)
    except (ValueError, NotImplementedError, TypeError) as e:
        return str(e).splitlines()[0]
    return None


def _tied_partners(module: nn.Module) -> dict[str, set[str]]:
    """Module name -> the other modules holding one of its own parameters (cached per model)."""
    cached = _PARTNERS.get(id(module))
    if cached is not None and cached[0] is module:
        return cached[1]
    result = _find_tied_partners(module)
    _PARTNERS.clear()
    _PARTNERS[id(module)] = (module, result)
    return result


_PARTNERS: dict[int, tuple[nn.Module, dict[str, set[str]]]] = {}


def _find_tied_partners(module: nn.Module) -> dict[str, set[str]]:
    holders: dict[int, list[str]] = {}
    for name, mod in module.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            if name not in holders.setdefault(id(p), []):
                holders[id(p)].append(name)
    out: dict[str, set[str]] = {}
    for names in holders.values():
        for n in names:
            out.setdefault(n, set()).update(m for m in names if m != n)
    return out


def decide_embeddings(trace: Trace, module: nn.Module, world_size: int, fixed: dict[str, str]) -> dict[str, Style]:
    """The embeddings the model's input ids are looked up in: split by vocabulary."""
    out: dict[str, Style] = {}
    for name, info in trace.layers.items():
        if info.kind is not EMBEDDING or name in fixed or info.roles != {"embedding"}:
            continue
        if not info.reads_model_input or info.foreign:
            continue
        entries = {name: EmbeddingParallel()}
        if _validate(module, entries, world_size) is None:
            out.update(entries)
    return out


def _resolve_ties(module: nn.Module, groups: list[Group], embeddings: dict[str, Style]) -> None:
    """A tensor shared by several modules (a tied embedding and head) must be split alike by all of them."""
    decided: dict[str, Style] = dict(embeddings)
    owner: dict[str, Group] = {}
    for g in groups:
        for k, v in g.entries.items():
            decided[k] = v
            owner[k] = g
    sharers: dict[int, list[str]] = {}
    for name, mod in module.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            sharers.setdefault(id(p), [])
            if name not in sharers[id(p)]:
                sharers[id(p)].append(name)
    for names in sharers.values():
        if len(names) < 2 or not any(n in decided for n in names):
            continue
        styles = [decided.get(n) for n in names]
        vocab_pair = all(
            isinstance(s, EmbeddingParallel) and s.split == "vocab" or isinstance(s, ColwiseParallel) and s.blocks is None
            for s in styles
        )
        if vocab_pair and any(isinstance(s, EmbeddingParallel) for s in styles):
            continue
        reason = f"its weight is shared with {', '.join(names)}, which the plan would split differently"
        for n in names:
            embeddings.pop(n, None)
            if n in owner and owner[n].outcome != "whole":
                owner[n].fail(reason)


def _record_failures(groups, trace: Trace, fixed: dict[str, str], fallbacks: list[Fallback], stage: str) -> bool:
    """Fix the columns of failed groups (and layers that can never split); True when a trace must rerun."""
    retrace = False
    for g in groups:
        if g.outcome != "whole" or not g.reason:
            continue
        if all(c in fixed for c in g.columns):
            continue  # failed before; nothing new
        fallbacks.append(Fallback(g.layers, g.reason, stage))
        for name in g.columns:
            fixed[name] = g.reason
        for name in g.rows:
            info = trace.layers[name]
            if info.foreign or len(info.roles) > 1:
                fixed[name] = g.reason
        # Its rows may pair with later layers, and layers its features reached may be columns: trace again.
        retrace = True
    return retrace


# --- the plan -------------------------------------------------------------------------------------------


def assemble(module: nn.Module, groups: list[Group], embeddings: dict[str, Style]) -> Plan:
    """Entries in module order; repeated layers collapse to one glob (``layers.*.attn.wq``) when every
    module the glob matches gets the same style."""
    decided: dict[str, Style] = dict(embeddings)
    for g in groups:
        decided.update(g.entries)
    names = [n for n, _ in module.named_modules()]
    by_depth: dict[int, list[str]] = {}
    for n in names:
        by_depth.setdefault(n.count("."), []).append(n)
    entries: list[tuple[str, Style]] = []
    emitted: set[str] = set()
    for name in names:
        if name not in decided:
            continue
        style = decided[name]
        pattern = ".".join("*" if seg.isdigit() else seg for seg in name.split(".")) if name else name
        if pattern != name:
            matched = [n for n in by_depth[name.count(".")] if match_pattern(pattern, n)]
            if not all(decided.get(n) == style for n in matched):
                pattern = _escape(name)
        else:
            pattern = _escape(name)
        if pattern not in emitted:
            emitted.add(pattern)
            entries.append((pattern, style))
    return Plan(entries)


def _escape(name: str) -> str:
    """A module name as a glob that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def _common_parent(names: list[str]) -> str:
    parts = [n.split(".") for n in names]
    common = []
    for segs in zip(*parts):
        if len(set(segs)) != 1:
            break
        common.append(segs[0])
    # The parent of leaf layers: never one of the layers themselves.
    while common and ".".join(common) in names:
        common.pop()
    return ".".join(common)


def _short(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _log_summary(module: nn.Module, world_size: int, r: Inference) -> None:
    kinds: dict[str, int] = {}
    for g in r.groups:
        if g.outcome != "whole":
            kinds[g.describe()] = kinds.get(g.describe(), 0) + 1
    parts = [f"{n} x {k}" for k, n in kinds.items()] + [f"{len(r.embeddings)} embedding(s) by vocabulary"] * bool(r.embeddings)
    logger.info(
        "inferred plan for %s over %d device(s): %s; %d fallback(s)%s",
        type(module).__name__, world_size, ", ".join(parts) or "nothing to split", len(r.fallbacks),
        f"; self-checked {r.checked} group(s)" if r.checked else "",
    )
    seen: set[tuple[str, str]] = set()
    for f in r.fallbacks:
        key = (".".join("*" if s.isdigit() else s for s in f.layers[0].split(".")), f.reason)
        if key not in seen:
            seen.add(key)
            logger.info("%s", f.line())
