"""Groups of column and row layers found by a trace, and what the plan does with each.

A *group* is a set of column layers and the row layers that consume their features (one attention, one
MLP, the output head): `find_groups` collects them from a trace, `decide` chooses per group:

- **split**: a column -> row group whose units lay out as blocks (structure.py), with a `Heads` entry on
  its smallest enclosing module when its units are heads, `SumGradients` for whole parameters its split
  features read (per-head norms), and `ChannelParallel` for the channel-wise layers its features pass
  through (a ConvNet's BatchNorms and depthwise convolutions between its column and row convolutions);
- **gather**: a lone column whose features only reach the model's output and which is as wide as the
  vocabulary of the embedding the input ids go to (the output head);
- **whole**: everything else, with the reason.

The entries of every decision are dry-run against the device count (`shard_plan`), so a head count that
does not group over the devices, or a block too small to split, is a fallback here, not an error later.
The embedding the model's input ids go to is split by vocabulary (`decide_embeddings`), and a weight
shared by several modules must be split alike by all of them (`resolve_ties`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..layers import EMBEDDING, weight_shape
from ..plans.direct_reads import direct_reads
from ..plans.plan import Plan, escape
from ..plans.sharding import shard_plan
from ..styles import ChannelParallel, ColwiseParallel, EmbeddingParallel, Heads, RowwiseParallel, Style, SumGradients
from ..styles.channel import channel_count
from .evidence import Poison, Trace
from .structure import Layout, LayoutError, head_attrs, infer_layout


@dataclass
class Group:
    """Columns and the rows that read their features; what the plan does with them and why."""

    columns: list[str]
    rows: list[str]
    poisons: list[Poison] = field(default_factory=list)
    syncs: set[tuple[str, str]] = field(default_factory=set)  # whole parameters read by its split features
    outcome: str = "whole"  # "split" | "gather" (output head) | "gathered" (own_forward.py) | "whole"
    reason: str = ""
    owner: str | None = None  # the module that gets the Heads entry
    layout: Layout | None = None
    entries: dict[str, Style] = field(default_factory=dict)
    channels: list[str] = field(default_factory=list)  # channel-wise layers its features pass through

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
        if self.outcome == "gathered":
            return "column, output gathered"
        return "column -> row pair" if self.rows else "column"


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
    for name, ids in trace.channels.items():  # a channel-wise layer joins the groups whose features it holds
        names.append(name)
        ids_of.append(fs.classes(ids))
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
    width = len(names) + 1
    for code in torch.unique(layer[meets] * width + first[meets]).tolist():  # (layer, earlier layer) pairs
        join(*divmod(code, width))
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
        channels = [n for n in group_names if n in trace.channels]
        cols = [n for n in group_names if n not in trace.channels and trace.layers[n].out_ids is not None]
        rows = [n for n in group_names if n not in cols and n not in channels]
        groups[r] = Group(cols, rows, channels=channels)

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
            lab = row_labels(fs, call.row_ids, info.kind.feature_dim)
            if lab is None:
                return g.fail(f"{name} reads split features that also vary along other dimensions, or mixed with whole ones")
            if seen is not None and not torch.equal(lab, seen):
                return g.fail(f"{name} is called on different features in different calls")
            seen = lab
        labels[name] = seen
    for name in g.channels:
        labels[name] = fs.find(trace.channels[name])
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
        g.owner = common_parent(g.layers)
        owner = module.get_submodule(g.owner)
        attrs = head_attrs(owner, layout, world_size, _column_holders(g.owner, g.columns))
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
    for name in g.channels:
        blocks = tuple(layout.blocks[name])
        size = channel_count(module.get_submodule(name))
        entries[name] = ChannelParallel(blocks=None if len(blocks) == 1 and blocks[0] == size else blocks)
    problem = validate_entries(module, entries, world_size)
    if problem:
        return g.fail(problem)
    for owner_name, pname in sorted(g.syncs):
        if owner_name in entries and not isinstance(entries[owner_name], SumGradients) or owner_name in g.layers:
            return g.fail(
                f"{owner_name}.{pname} is read by the split features but {owner_name} is split itself; "
                "its gradient cannot be summed (write a plan with ShardParams for it)"
            )
        entries[owner_name] = SumGradients()
    g.outcome, g.entries = "split", entries
    return g


def _gather(g: Group, info, world_size: int, module: nn.Module, trace: Trace) -> Group:
    """The output head: a lone column whose features reach the model's output, as wide as the vocabulary
    of the embedding the input ids go to. Split by output features, its logits gathered."""
    out_f = weight_shape(info.module)[info.kind.weight_out_dim]
    vocabularies = {
        other.module.num_embeddings for other in trace.layers.values() if other.kind is EMBEDDING and other.reads_model_input
    }
    if out_f not in vocabularies:
        return g.fail(f"its output reaches the model's output and is not a vocabulary ({out_f} features): not worth a gather")
    entries = {info.name: ColwiseParallel(gather_output=True)}
    problem = validate_entries(module, entries, world_size)
    if problem:
        return g.fail(problem)
    g.outcome, g.entries = "gather", entries
    return g


def row_labels(fs, ids: torch.Tensor, feature_dim: int) -> torch.Tensor | None:
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
    size = weight_shape(info.module)[info.kind.weight_in_dim if row else info.kind.weight_out_dim]
    if len(blocks) == 1 and blocks[0] == size:
        return None
    return tuple(blocks)


def validate_entries(module: nn.Module, entries: dict[str, Style], world_size: int) -> str | None:
    """Dry-run the entries (head grouping, block sizes against the device count); the error, if any.

    Modules that share a weight with an entry (a tied embedding and head) get the style that splits it
    alike for the dry run; whether they really do is settled for the whole plan (`_resolve_ties`)."""
    read = _read_directly(module)
    for name in entries:
        for t in module.get_submodule(name)._parameters:
            reader = read.get(f"{name}.{t}" if name else t)
            if reader is not None:
                return f"{reader or '<root>'} reads {name}.{t} itself instead of calling {name} (plans/direct_reads.py)"
    trial = dict(entries)
    partners = _tied_partners(module)
    for name in entries:
        for partner in partners.get(name, ()):
            if partner not in trial:
                is_embedding = isinstance(module.get_submodule(partner), (nn.Embedding, nn.EmbeddingBag))
                trial[partner] = EmbeddingParallel() if is_embedding else ColwiseParallel(gather_output=True)
    root = common_parent(list(trial)) if len(trial) > 1 else ""
    scope = module.get_submodule(root)  # only the subtree that holds the entries: fast on deep models
    local = {(k[len(root) + 1 :] if root else k) if k != root else "": v for k, v in trial.items()}
    try:
        shard_plan(scope, Plan({escape(k): v for k, v in local.items()}), world_size)
    except (ValueError, NotImplementedError, TypeError) as e:
        return str(e).splitlines()[0]
    return None


def _tied_partners(module: nn.Module) -> dict[str, set[str]]:
    """Module name -> the other modules holding one of its own parameters (cached per model)."""
    return _per_model(_PARTNERS, module, _find_tied_partners)


def _read_directly(module: nn.Module) -> dict[str, str]:
    """Tensor name -> a module that reads it without calling its owner (cached per model)."""
    return _per_model(_READS, module, lambda m: {t: r for r, reads in direct_reads(m).items() for t in reads})


_PARTNERS: dict[int, tuple[nn.Module, dict]] = {}
_READS: dict[int, tuple[nn.Module, dict]] = {}


def _per_model(cache: dict, module: nn.Module, compute):
    """compute(module), remembered for the one model being inferred (forget_model drops it)."""
    hit = cache.get(id(module))
    if hit is None or hit[0] is not module:
        cache.clear()
        cache[id(module)] = hit = (module, compute(module))
    return hit[1]


def forget_model() -> None:
    """Drop the cached tie structure and direct reads (they hold a reference to the model)."""
    _PARTNERS.clear()
    _READS.clear()


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
        if validate_entries(module, entries, world_size) is None:
            out.update(entries)
    return out


def resolve_conflicts(groups: list[Group]) -> None:
    """Two groups giving one module different styles (two attentions under one Heads owner, a SumGradients on
    another group's layer): the later group stays whole."""
    taken: dict[str, Style] = {}
    for g in groups:
        clash = next((k for k, v in g.entries.items() if k in taken and taken[k] != v), None)
        if clash is not None:
            g.fail(f"{clash or '<model>'} would need two different styles (another group uses it)")
            continue
        taken.update(g.entries)


def resolve_ties(module: nn.Module, groups: list[Group], embeddings: dict[str, Style]) -> None:
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


def shared_path(names: list[str]) -> list[str]:
    """The leading dotted segments all module names share ("" is the root: it shares nothing)."""
    common = []
    for segs in zip(*(n.split(".") if n else [] for n in names)):
        if len(set(segs)) != 1:
            break
        common.append(segs[0])
    return common


def _column_holders(owner: str, columns: list[str]) -> tuple[str, ...]:
    """The submodules between the attention owner and its column layers (relative to the owner): where
    q, k and v are reshaped into heads when the owner is a wrapper (BERT's ``attention.self``)."""
    holders = []
    for name in columns:
        rel = name[len(owner) + 1:].split(".")[:-1] if owner else name.split(".")[:-1]
        for i in range(1, len(rel) + 1):
            holders.append(".".join(rel[:i]))
    return tuple(dict.fromkeys(holders))


def common_parent(names: list[str]) -> str:
    common = shared_path(names)
    # The parent of leaf layers: never one of the layers themselves.
    while common and ".".join(common) in names:
        common.pop()
    return ".".join(common)
