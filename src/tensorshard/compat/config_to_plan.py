"""From a tensor_parallel `Config` to a tensorshard `Plan`: what each rule combination means, and what is refused.

The original applies its rules literally: each device gets its piece of every matched tensor, and the
input/output actions run around the matched modules. tensorshard's styles say the same thing per layer,
with collectives whose backward is exact. The translation reads the rules per module of the model:

    state rule on a layer's weight          + output rule              -> tensorshard style
    ---------------------------------------   ------------------------   ------------------------------------------
    split along output features (Linear 0,     none (a row layer reads    ColwiseParallel()
      Conv1D 1, Conv 0), bias split alike      it, split)
                                              "gather <feature dim>"     ColwiseParallel(gather_output=True)
    split along input features (Linear 1,      "sum" here or on a parent  RowwiseParallel(); an input rule
      Conv1D 0, Conv 1), bias "scale"d         module                     "split -1" is implied (whole inputs)
    Embedding split 1 (embedding dim)          "gather -1"                EmbeddingParallel(split="embedding")
    Embedding split 0 (vocabulary)             "sum"                      EmbeddingParallel(split="vocab")
    Embedding split 1                          none (the output stays     ShardParams(params={"weight": 1},
                                               split, as T5's per-head      input="split", output="split")
                                               position bias)
    a tensor of a module that is not a layer,  -                          ShardParams(..., input="split",
      tied to a split layer's (BERT's                                       output="split"): it only holds it
      cls.predictions.bias), split alike

SplitInChunks / SplitInGroupedChunks cut on chunk boundaries: the layer's blocks become head units
(``blocks=("q",)``, ``("q", "q", "q")`` for grouped q|k|v), and its parent module gets a `Heads` entry with
that many units (two chunk counts in one parent: query and key/value heads). A row layer's "scale"d bias
is kept whole and added once after the sum, which is the same forward and keeps training exact (a bias
divided by N on every device would train N times too fast). Attribute rules ("scale_int", or a callable
``f(value, rank=r)``) are evaluated for every device at translation time (styles/per_device.py).

A `SliceHeads` input rule on an attention (BLOOM's ALiBi, compat/head_inputs.py) makes its Heads entry an
``AttentionHeads(head_inputs=...)``.

Refused, by rule, before the model changes (`UntranslatableConfig` lists every problem): callables as
state, input or output rules (including the KV-cache plumbing of the original's presets: tensorshard
keeps each device's cache itself), splits of modules other than Linear / Conv1D / Conv / Embedding, a
row layer whose partial output no "sum" covers (or two do), a "sum" over nothing split, "gather" or
"split" anywhere else than above, "scale" on anything but a row layer's bias.

A PEFT model is read without its adapters, each adapted layer under its own name (bare.py); the plan's
entries for those layers become the layer's and its adapters' when the plan is resolved.

Finally the plan is checked against the config itself (check.py).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..layers import CONV, EMBEDDING, layer_kind
from ..logs import get_logger
from ..partition import HeadGroups
from ..plans.plan import Plan, match_pattern
from ..styles import (
    ColwiseParallel, EmbeddingParallel, Heads, HeadsWithValues, PerDeviceValues, RowwiseParallel, ShardParams, Style,
)
from ..styles.attention_heads import AttentionHeads
from .bare import bare_modules, bare_tensors
from .head_inputs import SliceHeads
from .check import UntranslatableConfig, check_against_config
from .rules import Rule, RuleTables, compile_pattern, pattern_text, read_action

logger = get_logger(__name__)


@dataclass
class _Module:
    """What the config's rules say about one module."""

    name: str
    module: nn.Module
    tensors: dict[str, Rule] = field(default_factory=dict)  # own tensor name -> state rule
    inputs: dict[Any, Any] = field(default_factory=dict)
    outputs: dict[Any, Any] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    role: str = ""  # "column" | "row" | "vocab" | "embedding" | "split output" | "holder" once classified
    units: int = 0  # head units per block, for chunked splits


def translate(config: RuleTables, model: nn.Module, world_size: int) -> Plan:
    if not isinstance(model, nn.Module):
        raise TypeError(f"translate a config for an nn.Module; got {type(model).__name__}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    problems: list[str] = []
    mods = _read_rules(config, model, world_size, problems)
    if world_size == 1:
        _raise(problems)
        return Plan()
    styles: dict[str, Style] = {}
    layer_tensors = {id(t) for m in mods.values() if layer_kind(m.module) for _, t in _own_tensors(m.module)}
    for m in mods.values():
        if m.tensors and layer_kind(m.module) is None and _only_ties(m, layer_tensors):
            styles[m.name] = _holder(m)
        elif m.tensors:
            style = _layer_style(m, problems)
            if style is not None:
                styles[m.name] = style
        else:
            _unsplit_module(m, problems)
    _check_sums(mods, problems)
    _heads_and_attrs(mods, styles, world_size, problems)
    _raise(problems)
    plan = Plan(_globs(styles, model))
    check_against_config(config, model, plan, world_size)
    logger.info("tensor_parallel config translated to a plan of %d entries over %d devices", len(plan), world_size)
    return plan


def _raise(problems: list[str]) -> None:
    if problems:
        raise UntranslatableConfig(
            f"{len(problems)} rule(s) of the tensor_parallel config have no tensorshard equivalent; nothing was "
            "changed:\n" + "\n".join(f"  - {p}" for p in problems)
            + "\nFix or drop these rules, or write a tensorshard Plan (docs/migrating.md, docs/plans.md)."
        )


# --- reading the rules -------------------------------------------------------------------------------------


def _read_rules(config: RuleTables, model: nn.Module, world_size: int, problems: list[str]) -> dict[str, _Module]:
    # A tensor's rule comes from its first name, as the original matches named_parameters() (tied weights
    # appear once): an output head tied to the embedding follows the embedding's rule.
    rule_of: dict[int, Rule] = {}
    used: set[str] = set()
    for name, t in bare_tensors(model):  # a PEFT model's layers under their own names (bare.py)
        hit = config.state_rule(name)
        if hit is None:
            continue
        pattern, action = hit
        used.add(pattern)
        rule = read_action(action, world_size)
        if isinstance(rule, str):
            problems.append(f"state_rules[{pattern_text(pattern)!r}] (matches {name}): {rule}")
            continue
        rule_of[id(t)] = rule
    unused = [pattern_text(p) for p in config.state_rules if p not in used]
    if unused:
        logger.warning("state rules that match no parameter or buffer: %s", unused)

    mods: dict[str, _Module] = {}
    for name, module in bare_modules(model):
        m = _Module(name, module)
        for tname, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None and id(t) in rule_of:
                m.tensors[tname] = rule_of[id(t)]
        for table, into in (("input_rules", m.inputs), ("output_rules", m.outputs), ("attr_rules", m.attrs)):
            merged, conflicts = config.module_rules(table, name)
            problems.extend(conflicts)
            into.update(merged)
        for table, actions in (("input_rules", m.inputs), ("output_rules", m.outputs)):
            for key, action in actions.items():
                if table == "input_rules" and isinstance(action, SliceHeads):
                    continue  # per-head inputs of an attention: its Heads entry slices them (_heads_and_attrs)
                if not isinstance(action, str) and _as_split(action) is None:
                    problems.append(
                        f"{table} for {name!r}, argument {key!r}: {action!r} is a Python callable, which tensorshard.compat "
                        "cannot translate. If it passes the KV cache between devices (select_kv_for_rank, gather_kv), "
                        "delete it: each device keeps the cache of its own heads. Else write a tensorshard Plan."
                    )
        if m.tensors or m.inputs or m.outputs or m.attrs:
            mods[name] = m
    names = [name for name, _ in bare_modules(model)]
    for table in ("input_rules", "output_rules", "attr_rules"):
        unused = [pattern_text(p) for p in getattr(config, table)
                  if not any(compile_pattern(p, table).search(n) for n in names)]
        if unused:
            logger.warning("%s that match no module: %s", table.replace("_", " "), unused)
    return mods


def _as_split(action: Any) -> str | None:
    """An input action given as a Split object (the original's automatic config does so): its string form."""
    if type(action).__name__ == "Split" and hasattr(action, "dim"):
        return f"split {action.dim}"
    return None


def _text(action: Any) -> str:
    return action if isinstance(action, str) else (_as_split(action) or repr(action))


def _parse(action: Any) -> tuple[str, int | None]:
    """'gather -1' -> ('gather', -1); 'sum' -> ('sum', None)."""
    kind, *opts = _text(action).split()
    return kind, (int(opts[0]) if opts and opts[0].lstrip("-").isdigit() else None)


# --- one split layer -----------------------------------------------------------------------------------------


def _layer_style(m: _Module, problems: list[str]) -> Style | None:
    kind = layer_kind(m.module)
    where = f"{m.name} ({type(m.module).__name__})"
    weight = m.tensors.get("weight")
    others = sorted(set(m.tensors) - {"weight", "bias"})
    if kind is None or weight is None or others or (kind is CONV and m.module.groups != 1):
        rules = ", ".join(f"{t}: {r.text}" for t, r in sorted(m.tensors.items()))
        problems.append(
            f"state rules on {where} ({rules}): tensorshard.compat translates splits of the weight (with its bias) "
            "of Linear, transformers' Conv1D, Conv1d/2d/3d with groups=1, Embedding and EmbeddingBag, and 'scale' on "
            "the bias of one split by input features. Write a tensorshard Plan for this module (ShardParams for "
            "custom parameters)."
        )
        return None
    if weight.kind != "split":
        problems.append(f"{where}: weight rule {weight.text} divides the weight on every device; only a bias may be scaled")
        return None
    ndim = m.module.weight.dim()
    if not -ndim <= weight.dim < ndim:
        problems.append(f"{where}: {weight.text} splits dim {weight.dim} of a {ndim}-D weight; use a dim in [{-ndim}, {ndim - 1}]")
        return None
    dim = weight.dim % ndim
    extra_out = sorted(k for k in m.outputs if k != 0)
    if extra_out:
        problems.append(f"{where}: output rules for outputs {extra_out}; a layer has one output")
    if kind is EMBEDDING:
        return _embedding(m, weight, dim, where, problems)
    blocks = _blocks(m, weight, m.module.weight.shape[dim], where, problems)
    if blocks is False:
        return None
    if dim == kind.weight_out_dim:
        return _column(m, kind, weight, blocks, where, problems)
    if dim == kind.weight_in_dim:
        return _row(m, kind, weight, blocks, where, problems)
    problems.append(f"{where}: {weight.text} splits weight dim {dim}, neither output ({kind.weight_out_dim}) nor input features")
    return None


def _output(m: _Module) -> tuple[Any, str | None, int | None]:
    """The layer's output rule, its kind and dim: ('gather -1', 'gather', -1); (None, None, None) if none."""
    out0 = m.outputs.get(0)
    return (out0, *_parse(out0)) if out0 is not None else (None, None, None)


def _own_tensors(module: nn.Module) -> list[tuple[str, Any]]:
    return [(n, t) for n, t in list(module._parameters.items()) + list(module._buffers.items()) if t is not None]


def _only_ties(m: _Module, layer_tensors: set[int]) -> bool:
    """Every split tensor of this module (not a layer) is also a tensor of a layer the rules split: a holder
    such as BERT's ``cls.predictions``, whose bias is its decoder's bias."""
    own = dict(_own_tensors(m.module))
    return all(r.kind == "split" and r.chunk == 1 and r.groups == 1 and id(own[n]) in layer_tensors for n, r in m.tensors.items())


def _holder(m: _Module) -> Style:
    """A module that only holds tensors of split layers: its copies are split alike, and its forward (the
    layer's, inside) needs no collective of its own."""
    m.role = "holder"
    return ShardParams(params={n: r.dim for n, r in m.tensors.items()}, input="split", output="split")


def _embedding(m: _Module, weight: Rule, dim: int, where: str, problems: list[str]) -> Style | None:
    out0, out_kind, out_dim = _output(m)
    if weight.chunk != 1 or weight.groups != 1 or m.inputs:
        problems.append(f"{where}: an embedding is split by rows or columns only, with no input rules")
        return None
    if dim == 1 and out_kind == "gather" and out_dim == -1:
        m.role = "embedding"
        return EmbeddingParallel(split="embedding")
    if dim == 0 and out_kind == "sum":
        m.role = "vocab"
        return EmbeddingParallel(split="vocab")
    if dim == 1 and out0 is None:  # each device looks up its own columns (T5's per-head position bias)
        m.role = "split output"
        return ShardParams(params={"weight": 1}, input="split", output="split")
    need = "'gather -1' on its output (or no output rule: its output stays split)" if dim == 1 else "'sum' on its output"
    problems.append(f"{where}: weight {weight.text} needs {need}; got {_text(out0) if out0 is not None else 'none'}")
    return None


def _column(m: _Module, kind, weight: Rule, blocks, where: str, problems: list[str]) -> Style | None:
    """Each device computes some output features from the whole input."""
    m.role = "column"
    bias = m.tensors.get("bias")
    alike = bias is not None and (bias.kind, bias.dim in (0, -1), bias.chunk, bias.groups) == ("split", True, weight.chunk, weight.groups)
    if getattr(m.module, "bias", None) is not None and not alike:
        problems.append(
            f"{where}: the weight is split by output features ({weight.text}) but the bias by "
            f"{bias.text if bias else 'nothing (kept whole)'}; split the bias alike (dim 0, same chunks)"
        )
    if m.inputs:
        problems.append(f"{where}: input rules {m.inputs} on a layer split by output features; it reads its whole input")
    out0, out_kind, out_dim = _output(m)
    if out_kind is None:
        return ColwiseParallel(blocks=blocks)
    if out_kind == "gather" and out_dim == kind.feature_dim:
        return ColwiseParallel(gather_output=True, blocks=blocks)
    problems.append(
        f"{where}: output rule {_text(out0)!r} on a layer split by output features; use 'gather {kind.feature_dim}' "
        "(whole output on every device) or no rule (a layer split by input features reads it)"
    )
    return None


def _row(m: _Module, kind, weight: Rule, blocks, where: str, problems: list[str]) -> Style | None:
    """Each device multiplies its slice of the input features: partial sums, which a 'sum' adds up."""
    m.role = "row"
    bias = m.tensors.get("bias")
    if getattr(m.module, "bias", None) is not None and (bias is None or bias.kind != "scale"):
        problems.append(
            f"{where}: the weight is split by input features ({weight.text}) but the bias is "
            f"{bias.text if bias else 'kept whole'}; with a 'sum' after it, the original adds it once per device. "
            "Give the bias 'scale' (tensorshard then adds it once, after the sum)"
        )
    for key, action in m.inputs.items():
        split, d = _parse(action)
        if not (key == 0 and split == "split" and d == kind.feature_dim):
            problems.append(
                f"{where}: input rule {key!r}: {_text(action)!r}; a layer split by input features accepts only "
                f"'split {kind.feature_dim}' on its first input"
            )
    out0, out_kind, _ = _output(m)
    if out0 is not None and out_kind != "sum":
        problems.append(f"{where}: output rule {_text(out0)!r} on a layer split by input features; it needs 'sum'")
    return RowwiseParallel(blocks=blocks)


def _blocks(m: _Module, rule: Rule, size: int, where: str, problems: list[str]):
    """The style's `blocks` for a chunked split (None: plain; False: refused)."""
    if size % rule.groups or (size // rule.groups) % rule.chunk:
        problems.append(f"{where}: {rule.text} does not fit the dimension's {size} features")
        return False
    if rule.chunk == 1:
        return None if rule.groups == 1 else (size // rule.groups,) * rule.groups
    m.units = size // rule.groups // rule.chunk
    return ("q",) * rule.groups  # "q" for now; _heads_and_attrs may make it "kv"


def _unsplit_module(m: _Module, problems: list[str]) -> None:
    for key, action in m.inputs.items():
        if isinstance(action, SliceHeads):
            continue  # the attention's Heads entry (_heads_and_attrs)
        problems.append(f"input rule {key!r}: {_text(action)!r} on {m.name!r}, which the state rules do not split")
    for key, action in m.outputs.items():
        kind, _ = _parse(action)
        if key == 0 and kind == "sum":
            continue  # a sum over the row-split layers inside: _check_sums
        problems.append(
            f"output rule {key!r}: {_text(action)!r} on {m.name!r}, which the state rules do not split"
            + ("; put 'gather' on the split layer itself" if kind == "gather" else "")
        )


def _inside(name: str, parent: str) -> bool:
    return parent == "" or name == parent or name.startswith(parent + ".")


def _check_sums(mods: dict[str, _Module], problems: list[str]) -> None:
    """Every row-split layer (or vocabulary-split embedding) has exactly one 'sum' on itself or a parent."""
    sums = [m.name for m in mods.values() if m.outputs.get(0) is not None and _parse(m.outputs[0])[0] == "sum"]
    partial = [m.name for m in mods.values() if m.role in ("row", "vocab")]
    for name in sums:
        if not any(_inside(p, name) for p in partial):
            problems.append(f"output rule 'sum' on {name!r}: nothing inside it is split by input features, so there is nothing to sum")
    for name in partial:
        covering = [s for s in sums if _inside(name, s)]
        if len(covering) != 1:
            problems.append(
                f"{name!r} is split by input features, so each device holds a partial sum; "
                + ("no output rule 'sum' covers it (add {0: 'sum'} for it or its parent)" if not covering
                   else f"'sum' is applied {len(covering)} times ({', '.join(map(repr, covering))}); keep one")
            )


# --- heads and attributes ----------------------------------------------------------------------------------


def _heads_and_attrs(mods: dict[str, _Module], styles: dict[str, Style], world: int, problems: list[str]) -> None:
    units_by_parent: dict[str, list[_Module]] = defaultdict(list)
    for m in mods.values():
        if m.units and m.name in styles:
            units_by_parent[m.name.rpartition(".")[0]].append(m)
    geometry: dict[str, tuple[int, int]] = {}
    for parent, layers in units_by_parent.items():
        counts = sorted({m.units for m in layers})
        if len(counts) > 2 or counts[-1] % counts[0]:
            problems.append(
                f"layers inside {parent or '<root>'!r} are split in chunks of {', '.join(f'{m.name}: {m.units}' for m in layers)} "
                "units; tensorshard needs one head count, or query and key/value head counts where one divides the other"
            )
            continue
        geometry[parent] = (counts[-1], counts[0])
        for m in layers:
            if m.units != counts[-1]:  # the smaller count: key/value heads
                style = styles[m.name]
                styles[m.name] = type(style)(**{**style.options(), "blocks": ("kv",) * len(style.blocks)})
        if parent in styles:
            problems.append(f"{parent!r} is itself split and holds chunk-split layers; tensorshard cannot nest them")

    for m in mods.values():
        values = _attr_values(m, world, problems)
        if m.role:  # a split layer: its style sets its own sizes (in_features, nf, embedding_dim...)
            if m.attrs:
                logger.debug("%s: attribute rules %s skipped; the layer's style sets its sizes", m.name, sorted(m.attrs))
            continue
        if m.name in geometry:
            heads, kv = geometry.pop(m.name)
            attrs = _as_quantities(values, m.module, heads, kv, world)  # values that are the local head counts
            values = {a: v for a, v in values.items() if a not in attrs}
            kv_heads = kv if kv != heads else None
            sliced = {k: a.layout for k, a in m.inputs.items() if isinstance(a, SliceHeads)}
            head_dim, features = _feature_counts(values, m.module, heads, kv, world) if sliced else (None, {})
            attrs |= features
            values = {a: v for a, v in values.items() if a not in features}
            if sliced and values:
                problems.append(f"{m.name!r}: per-head inputs {sorted(sliced)} together with per-device attribute values "
                                f"{sorted(values)}; tensorshard's AttentionHeads takes head counts only")
            elif sliced:  # BLOOM's ALiBi (head_inputs.py)
                styles[m.name] = AttentionHeads(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, attrs=attrs,
                                                head_inputs=sliced)
            else:
                styles[m.name] = (
                    HeadsWithValues(num_heads=heads, num_kv_heads=kv_heads, attrs=attrs, values=values) if values
                    else Heads(num_heads=heads, num_kv_heads=kv_heads, attrs=attrs)
                )
        elif values:
            styles[m.name] = PerDeviceValues(values=values)
    for parent, (heads, kv) in geometry.items():  # parents without attribute rules
        styles[parent] = Heads(num_heads=heads, num_kv_heads=kv if kv != heads else None)


def _as_quantities(values: dict[str, tuple], module: nn.Module, heads: int, kv: int, world: int) -> dict[str, str]:
    """Attributes whose per-device values are a `Heads` quantity (local query heads, KV heads, group size),
    and whose value on the unsplit module is that quantity's there too: with 32 heads and 8 KV heads over 2
    devices, 4 local KV heads and a group size of 4 have the same values, and only the unsplit one tells them
    apart."""
    try:
        local = [HeadGroups.build(heads, kv, world).local(r) for r in range(world)]
        whole = HeadGroups.build(heads, kv, 1).local(0)
    except ValueError:
        return {}  # the geometry itself is refused when the plan is checked
    out = {}
    for attr, per_rank in values.items():
        for quantity in ("heads", "kv_heads", "groups"):
            if tuple(l[quantity] for l in local) == tuple(per_rank) and getattr(module, attr, None) == whole[quantity]:
                out[attr] = quantity
                break
    return out


def _feature_counts(values: dict[str, tuple], module: nn.Module, heads: int, kv: int, world: int) -> tuple[int | None, dict[str, str]]:
    """(head_dim, {attribute: "features" / "kv_features"}) for attributes whose per-device values are the local
    heads times one head width, and whose unsplit value is all heads' (BLOOM's hidden_size, split_size)."""
    try:
        local = [HeadGroups.build(heads, kv, world).local(r) for r in range(world)]
    except ValueError:
        return None, {}
    head_dim, out = None, {}
    for attr, per_rank in values.items():
        whole = getattr(module, attr, None)
        if isinstance(whole, bool) or not isinstance(whole, int):
            continue
        for quantity, count in (("features", "heads"), ("kv_features", "kv_heads")):
            full = heads if count == "heads" else kv
            if whole % full or head_dim not in (None, whole // full):
                continue
            if tuple(l[count] * (whole // full) for l in local) == tuple(per_rank):
                head_dim, out[attr] = whole // full, quantity
                break
    return head_dim, out


def _attr_values(m: _Module, world: int, problems: list[str]) -> dict[str, tuple]:
    out = {}
    for attr, action in m.attrs.items():
        where = f"attr_rules for {m.name!r}, {attr!r}"
        if not hasattr(m.module, attr):
            problems.append(f"{where}: {type(m.module).__name__} has no attribute {attr!r}")
            continue
        value = getattr(m.module, attr)
        if action == "scale_int":
            if not isinstance(value, int) or value % world:
                problems.append(f"{where}: 'scale_int' divides {value!r} by {world}, which leaves a remainder; use a callable")
                continue
            out[attr] = (value // world,) * world
        elif callable(action):
            try:
                out[attr] = tuple(action(value, rank=r) for r in range(world))
            except Exception as e:  # noqa: BLE001 - the user's function; report it with the rule
                problems.append(f"{where}: calling {action!r}({value!r}, rank=...) raised {type(e).__name__}: {e}")
        else:
            problems.append(f"{where}: {action!r} is not an attribute rule ('scale_int' or a callable f(value, rank=))")
    return out


# --- plan entries ------------------------------------------------------------------------------------------------


def _globs(styles: dict[str, Style], model: nn.Module) -> list[tuple[str, Style]]:
    """Entries by exact module name, with numbered segments folded into ``*`` where the glob matches
    exactly the modules that share the style (``layers.*.mlp.fc1``)."""
    names = [n for n, _ in model.named_modules()]
    order = {n: i for i, n in enumerate(names)}
    entries: dict[str, Style] = {}
    for name, style in sorted(styles.items(), key=lambda item: order[item[0]]):
        glob = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)
        if glob in entries:
            continue
        matched = [n for n in names if match_pattern(glob, n)]
        if glob != name and all(styles.get(n) == style for n in matched):
            entries[glob] = style
        else:
            entries[name] = style
    return list(entries.items())
