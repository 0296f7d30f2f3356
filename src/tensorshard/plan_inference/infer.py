"""Plan inference: a plan for a model nobody wrote one for, read from how its features flow.

    plan = tp.infer_plan(model, world_size=4)           # a Plan like a hand-written one
    report = tensorshard.plan_inference.infer.infer(model, 4, check=True)  # the plan, its groups and every fallback

1. Trace (trace.py): one forward pass on a tiny synthetic input records, per column candidate, which
   features must stay together (units), which rows consume them, and what poisons them.
2. Group and decide (groups.py): columns and rows that share units form a group (an attention, an MLP,
   the output head); a group whose units lay out as blocks (structure.py) is split, the vocabulary head
   gathers its output, the embedding of the input ids is split by vocabulary. Everything else stays whole,
   and each such fallback is logged once with its reason.
3. A group that falls back frees its rows to pair with later layers: trace again with its columns fixed,
   until nothing changes. With ``check=True`` every split group is then verified numerically in
   isolation (selfcheck.py); a mismatch is one more fallback.
4. Parts the pass did not reach (a vision-language model's vision tower on a text input) get plans of
   their own, inferred on their own inputs (parts.py).

The communication this reaches is a hand-written plan's: per transformer block one all-reduce forward
after attention and one after the MLP, and one backward for each (q, k, v read one tensor).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..layers import layer_kind
from ..logs import get_logger
from ..plans.plan import Plan, match_pattern
from ..plans.sharding import shard_plan
from ..styles import Style
from .evidence import Trace
from .groups import (
    Group, decide, decide_embeddings, escape, find_groups, forget_model, resolve_conflicts, resolve_ties,
)
from .inputs import as_inputs, first_that_runs, input_candidates
from .parts import infer_parts, prefixed
from .own_forward import gathered_own_forward
from .selfcheck import check_entries
from .trace import trace_model

logger = get_logger(__name__)

MAX_ROUNDS = 8




@dataclass
class Fallback:
    layers: list[str]
    reason: str
    stage: str  # "structure" or "self-check"
    # A split that did not happen: the group had a row, or several columns whose features meet (q, k and v of
    # an attention with a single head). A lone column never had one; it is logged at DEBUG only.
    paired: bool = True

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
    parts: dict[str, "Inference"] = field(default_factory=dict)  # unreached parts, inferred on their own


def infer_plan(
    module: nn.Module, world_size: int, *, example_inputs: Any = None, check: bool | None = None
) -> Plan:
    """A plan for `module` over `world_size` devices, inferred from its structure (see module docstring).

    Args:
        example_inputs: what to run the model on (a tensor, a tuple of args or a dict of kwargs);
            default: ``input_ids`` for a transformers model, else a tiny input shaped for its first layer.
        check: verify every split group numerically on a copy of its module, keeping the ones that fail
            whole (see selfcheck.py for the memory it needs). Default: on wherever there are numbers to
            check (over 2 or more devices, weights not on the meta device), as for a model split without a
            plan: a plan from the structure alone can miss what the forward computes from a head count.
    """
    if check is None:
        check = world_size > 1 and not any(p.is_meta for p in module.parameters())
    return infer(module, world_size, example_inputs=example_inputs, check=check).plan


def infer(module: nn.Module, world_size: int, *, example_inputs: Any = None, check: bool = False) -> Inference:
    """`infer_plan` with the full report: groups, fallbacks and the last trace."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"plan inference reads an nn.Module; got {type(module).__name__}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    if example_inputs is None and not any(layer_kind(m) is not None for m in module.modules()):
        return _nothing_to_split(module)
    forget_model()
    try:
        return _infer(module, world_size, example_inputs, check)
    finally:
        forget_model()


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
        resolve_conflicts(groups)
        resolve_ties(module, groups, embeddings)
        retrace = _record_failures(groups, trace, fixed, fallbacks, "structure")
        if not retrace and check:
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
            resolve_ties(module, groups, embeddings)
            retrace = _record_failures(groups, trace, fixed, fallbacks, "self-check")
        if not retrace and _refuse_unvalidated(module, groups, embeddings, world_size):
            retrace = _record_failures(groups, trace, fixed, fallbacks, "layout check")
        if not retrace:
            break
    if check:
        groups += gathered_own_forward(module, trace, fixed, world_size, verdicts)
        checked += sum(1 for g in groups if g.outcome == "gathered")
        fallbacks = [f for f in fallbacks if not all(n in {c for g in groups if g.outcome == "gathered" for c in g.columns}
                                                      for n in f.layers)]
    plan = assemble(module, groups, embeddings)
    gathered = {c for g in groups if g.outcome == "gathered" for c in g.columns}
    plan.whole.update({layer: f"plan inference kept it whole ({f.reason})" for f in fallbacks for layer in f.layers
                       if layer not in gathered})
    parts = {}
    if example_inputs is None:  # given inputs reach what the caller wants reached
        parts = infer_parts(module, set(trace.call_order), lambda part: _infer(part, world_size, None, check))
        if parts:
            merged = Plan(list(plan.items()) + [e for name, r in parts.items() for e in prefixed(name, r.plan)])
            merged.whole.update(plan.whole)
            for name, r in parts.items():
                merged.whole.update({f"{name}.{layer}" if layer else name: why for layer, why in r.plan.whole.items()})
            plan = merged
    result = Inference(plan, groups, embeddings, fallbacks, trace, rounds, checked, parts)
    _log_summary(module, world_size, result)
    return result


def _nothing_to_split(module: nn.Module) -> Inference:
    """No layer any style splits (a stack of ConvTranspose1d, say): an empty plan, at any device count, with
    no input to build; the split warns that it splits nothing (engines/split_report.py)."""
    plan = Plan()
    plan.whole.update({
        name: f"no style splits a {type(m).__name__}" for name, m in module.named_modules() if any(True for _ in m.parameters(recurse=False))
    })
    logger.info("inferred plan for %s: nothing to split (no Linear, Conv or Embedding layer)", type(module).__name__)
    return Inference(plan, [], {}, [], None, 0)


def _refuse_unvalidated(module: nn.Module, groups: list[Group], embeddings: dict[str, Style], world_size: int) -> bool:
    """Dry-run the whole plan as the engine will (shard_plan's layout checks read neighbours in module
    order, so a pair split across sibling blocks, column at the end of one and row at the start of the
    next, can look wrong to them). Groups the error names stay whole; True when any did."""
    try:
        shard_plan(module, assemble(module, groups, embeddings), world_size)
        return False
    except (ValueError, NotImplementedError, TypeError) as e:
        message = str(e)
    named = [g for g in groups if g.outcome != "whole" and any(_names(message, n) for n in g.layers + g.channels)]
    for g in named:
        g.fail(f"the whole plan's layout check refused it: {message.splitlines()[0]}")
    return bool(named)


def _names(message: str, name: str) -> bool:
    """`message` mentions module `name` itself (not a longer name it prefixes)."""
    start = message.find(name)
    while start >= 0:
        end = start + len(name)
        if (start == 0 or not (message[start - 1].isalnum() or message[start - 1] in "._")) and (
                end == len(message) or not (message[end].isalnum() or message[end] in "_") and
                not (message[end] == "." and end + 1 < len(message) and message[end + 1].isalnum())):
            return True
        start = message.find(name, start + 1)
    return False


def _first_input_that_runs(module: nn.Module):
    """The first synthetic input the model runs on (see `input_candidates`), or the error of the first."""
    try:
        return first_that_runs(module, lambda inputs: trace_model(module, inputs, capture=False))
    except Exception:
        _run(module, next(input_candidates(module)), {}, False)  # raises, with the first guess's error and the fix
        raise


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




def _record_failures(groups, trace: Trace, fixed: dict[str, str], fallbacks: list[Fallback], stage: str) -> bool:
    """Fix the columns of failed groups (and layers that can never split); True when a trace must rerun."""
    retrace = False
    for g in groups:
        if g.outcome != "whole" or not g.reason:
            continue
        if all(c in fixed for c in g.columns):
            continue  # failed before; nothing new
        paired = bool(g.rows) or g.layout is not None or len(g.columns) > 1
        fallbacks.append(Fallback(g.layers, g.reason, stage, paired=paired))
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
                pattern = escape(name)
        else:
            pattern = escape(name)
        if pattern not in emitted:
            emitted.add(pattern)
            entries.append((pattern, style))
    return Plan(entries)




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
        type(module).__name__, world_size, ", ".join(parts) or "nothing to split", sum(f.paired for f in r.fallbacks),
        f"; self-checked {r.checked} group(s)" if r.checked else "",
    )
    seen: set[tuple[str, str]] = set()
    for f in r.fallbacks:
        key = (".".join("*" if s.isdigit() else s for s in f.layers[0].split(".")), f.reason)
        if key not in seen:
            seen.add(key)
            logger.log(logging.INFO if f.paired else logging.DEBUG, "%s", f.line())
