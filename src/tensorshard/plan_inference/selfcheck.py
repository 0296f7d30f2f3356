"""The numerical self-check of an inferred plan, one region at a time, before the model is split.

For each group of plan entries (one attention, one MLP, the head), the *region* is the smallest module
that holds all of them and whose input the trace captured. The check builds a scratch copy of that
region, in fp32 on the CPU with fresh random weights (so it needs none of the real weights, and a layer
initialised to zero cannot hide a mistake), splits a second copy with just these entries over
``["cpu"] * world_size``, and runs both on the captured input: outputs, input gradients and every
parameter gradient must agree within `TOLERANCE` (LLM.int8() regions: within 8-bit's own error, since
their activations are quantized per device; quantized weights keep their values). Anything else (an
error while splitting or running, a shape or value mismatch) is a failure, reported as one line that says
why.

Memory: three fp32 copies of one region's parameters at a time (the reference, the split copy, the
random source), e.g. one transformer MLP; a group that spans the whole model (a custom model whose
column and row layers sit at the top level) makes the region the whole model. Regions with the same
structure (every transformer block alike) are checked once.
"""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .. import quant
from ..layers import layer_kind
from ..engines.inprocess import TensorParallel
from ..logs import get_logger
from ..plans.plan import Plan
from ..styles import ColwiseParallel, Heads, Replicate, Style
from .evidence import Trace
from .groups import find_groups, shared_path
from .inputs import as_inputs, first_that_runs
from .layer_roles import fresh_state, output_tensors
from .trace import trace_model

TOLERANCE = 1e-4  # relative (norm) error, fp32; a wrong split is off by O(1)

logger = get_logger(__name__)


def check_entries(
    module: nn.Module, trace: Trace, entries: dict[str, Style], world_size: int, cache: dict | None = None
) -> str | None:
    """None when the region holding `entries` computes the same split as whole; else the reason."""
    region = _region(trace, list(entries))
    sub = module.get_submodule(region)
    inputs = trace.captures.get(region) if region else trace.inputs
    if region and inputs is None:
        inputs = trace.inputs
        region, sub = "", module
    local = {_relative(name, region): style for name, style in entries.items()}
    keep = _whole_outputs(trace, region, entries)
    key = (type(sub).__qualname__, repr(sub), repr(sorted((k, v.to_dict()) for k, v in local.items())), tuple(keep))
    if cache is not None and key in cache:
        return cache[key]
    try:
        verdict = _compare(_Outputs(sub, keep), {_inner(k): v for k, v in local.items()}, inputs, world_size, region)
    except Exception as e:  # never let the check itself break wrapping: a failed check is a fallback
        verdict = f"could not run the split copy ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if cache is not None:
        cache[key] = verdict
    logger.debug("self-check of %s (%s): %s", region or "<model>", ", ".join(local), verdict or "ok")
    return verdict


def _whole_outputs(trace: Trace, region: str, entries: dict[str, Style]) -> list[bool]:
    """Which outputs of the region are whole under `entries` (not features of a column they split without
    gathering, such as attention weights returned next to the attention's output): the ones to compare."""

    split = [trace.layers[n].out_ids for n, s in entries.items()
             if isinstance(s, ColwiseParallel) and not s.gather_output and n in trace.layers and trace.layers[n].out_ids is not None]
    classes = set(trace.fs.find(torch.cat(split)).tolist()) if split else set()
    keep = []
    for ids in trace.split_outputs.get(region, []):
        keep.append(ids is None or not classes & set(torch.unique(trace.fs.find(ids[ids >= 0])).tolist()))
    return keep


class _Outputs(nn.Module):
    """The region, returning only its outputs that are whole in the split model, as a tuple."""

    def __init__(self, inner: nn.Module, keep: list[bool]) -> None:
        super().__init__()
        self.inner, self.keep = inner, keep

    def forward(self, *args, **kwargs):
        outs = output_tensors(self.inner(*args, **kwargs))
        if len(outs) != len(self.keep):
            return tuple(outs)
        return tuple(t for t, k in zip(outs, self.keep) if k)


def _inner(name: str) -> str:
    return f"inner.{name}" if name else "inner"


def _region(trace: Trace, names: list[str]) -> str:
    common = shared_path(names)
    while common and trace.captures.get(".".join(common)) is None:
        common.pop()
    return ".".join(common)


def _relative(name: str, region: str) -> str:
    rel = name[len(region) + 1 :] if region else name
    rel = "" if name == region else rel
    return "".join(f"[{c}]" if c in "*?[]" else c for c in rel)


def _compare(sub: nn.Module, entries: dict[str, Style], inputs: tuple[tuple, dict], world_size: int, region: str) -> str | None:
    gen = torch.Generator().manual_seed(1234)
    tolerance = quant.selfcheck_tolerance(sub, TOLERANCE)
    ref = _Outputs(scratch_copy(sub.inner, gen), sub.keep)
    work = copy.deepcopy(ref)
    with _quiet():  # check=False: these entries are the pair being checked, by numbers instead
        split = TensorParallel(work, ["cpu"] * world_size, plan=Plan(entries), check=False)
    ref.eval()
    split.eval()
    # Inputs that carried gradients in the traced pass carry them here (at the top level: all of them).
    args_ref, args_split = _inputs(inputs, everything=not region), _inputs(inputs, everything=not region)
    out_ref = ref(*args_ref[0], **args_ref[1])
    out_split = split(*args_split[0], **args_split[1])
    ys_ref, ys_split = _floats(out_ref), _floats(out_split)
    if len(ys_ref) != len(ys_split):
        return f"the split copy returns {len(ys_split)} floating outputs, the whole one {len(ys_ref)}"
    for i, (a, b) in enumerate(zip(ys_split, ys_ref)):
        if a.shape != b.shape:
            return f"output {i} has shape {tuple(a.shape)} split but {tuple(b.shape)} whole"
        err = _rel_err(a, b, _norm(b))
        if not err <= tolerance:
            return f"output {i} differs from the unsplit module (relative error {err:.1e})"
    with torch.no_grad():  # inference can take other code paths (PyTorch's fused encoder layer does)
        again_ref, again_split = _inputs(inputs, everything=False), _inputs(inputs, everything=False)
        plain_ref, plain_split = _floats(ref(*again_ref[0], **again_ref[1])), _floats(split(*again_split[0], **again_split[1]))
    for i, (a, b) in enumerate(zip(plain_split, plain_ref)):
        if a.shape != b.shape or not _rel_err(a, b, _norm(b)) <= tolerance:
            return f"output {i} differs from the unsplit module without gradients (inference takes another path)"
    weights = [torch.randn(y.shape, generator=gen) for y in ys_ref]
    grads = [y for y in ys_ref if y.requires_grad]
    if not grads:
        return None
    sum((y * w).sum() for y, w in zip(ys_ref, weights) if y.requires_grad).backward()
    sum((y * w).sum() for y, w in zip(ys_split, weights) if y.requires_grad).backward()
    # A gradient is compared relative to its own size, or to the largest gradient of the region when it is
    # (nearly) zero by symmetry: a key bias has no effect through softmax, so its gradient is rounding noise.
    scale = max([_norm(p.grad) for p in ref.parameters() if p.grad is not None] + [_norm(t.grad) for t in _leaves(args_ref) if t.grad is not None] + [0.0])
    floor = 1e-3 * scale
    for i, (a, b) in enumerate(zip(_leaves(args_split), _leaves(args_ref))):
        if (a.grad is None) != (b.grad is None):
            return f"input {i} gets a gradient in only one of the two"
        if a.grad is not None and not _rel_err(a.grad, b.grad, floor) <= tolerance:
            return f"the gradient of input {i} differs (relative error {_rel_err(a.grad, b.grad, floor):.1e})"
    for name, p in ref.named_parameters():
        per_shard = [shard.get_parameter(name).grad for shard in split.module_shards]
        path = _path(name, region)
        if p.grad is None:
            if any(g is not None and g.abs().max() > 0 for g in per_shard):
                return f"{path} gets a gradient only when split"
            continue
        if any(g is None for g in per_shard):
            return f"{path} gets no gradient on some device"
        split_of = split.splits.get(name)
        if split_of is None:
            candidates = per_shard  # replicated: every copy must hold the full gradient
        else:
            dim, part = split_of
            candidates = [part.assemble([g.detach() for g in per_shard], dim)]
        for g in candidates:
            err = _rel_err(g, p.grad, floor)
            if not err <= tolerance:
                return f"the gradient of {path} differs (relative error {err:.1e})"
    return None


def _path(name: str, region: str) -> str:
    """A parameter of the checked copy ("inner.up.weight") by its path in the model ("mlp.up.weight")."""
    rel = name.removeprefix("inner.")
    return f"{region}.{rel}" if region else rel


def scratch_copy(sub: nn.Module, gen: torch.Generator) -> nn.Module:
    """An fp32 CPU copy of `sub` with the same buffers and fresh random parameters (quantized weights keep
    their values: random packed codes would not be a quantized weight)."""
    memo: dict[int, Any] = {}
    for p in sub.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(0), requires_grad=p.requires_grad)
    clone = copy.deepcopy(sub, memo)
    originals = dict(sub.named_parameters(remove_duplicate=False))
    done: dict[int, nn.Parameter] = {}
    for mod_name, mod in clone.named_modules(remove_duplicate=False):
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            original = originals[full]
            if id(p) not in done and quant.weight_kind(original):  # quantized: its own values, copied
                done[id(p)] = quant.take(original, sub.get_submodule(mod_name), None, 0, torch.device("cpu"))
            if id(p) not in done:
                done[id(p)] = nn.Parameter(_random_like(original, gen), requires_grad=p.requires_grad)
            mod._parameters[pname] = done[id(p)]
            if quant.weight_kind(done[id(p)]):
                quant.finish_module(mod)
    return clone.to(device="cpu").float()


def _random_like(p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if not p.is_floating_point():
        return p.detach().to("cpu").clone()
    if p.dim() >= 2:
        fan_in = max(p.numel() // p.shape[0], 1)
        return torch.randn(p.shape, generator=gen) / fan_in**0.5
    base = p.detach().to("cpu", torch.float32) if not p.is_meta else torch.zeros(p.shape)
    return base + 0.1 * torch.randn(p.shape, generator=gen)


def _inputs(inputs: tuple[tuple, dict], everything: bool) -> tuple[tuple, dict]:
    def prep(t):
        if not isinstance(t, torch.Tensor):
            return fresh_state(t)  # each run appends to its own copy of a KV cache
        grad = t.is_floating_point() and (everything or t.requires_grad)
        t = t.detach().to("cpu")
        if t.is_floating_point():
            return t.float().clone().requires_grad_(grad)
        return t.clone()

    return tree_map(prep, inputs)


def _leaves(inputs: tuple[tuple, dict]) -> list[torch.Tensor]:
    return [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _floats(out: Any) -> list[torch.Tensor]:
    return [t for t in output_tensors(out) if t.is_floating_point()]


def _norm(t: torch.Tensor) -> float:
    return t.detach().double().norm().item()


def _rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """|a - b| / max(|b|, floor), in norms (fp64)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / max(b.norm().item(), floor, 1e-30)).item()


@contextmanager
def _quiet():
    """Keep the engine's per-split log lines (engines/split_report.py: a region is a small part of the
    model) out of the user's log while checking."""
    quieter = {
        "tensorshard.engines.inprocess.engine": logging.WARNING,
        "tensorshard.engines.split_report": logging.ERROR,
        # the layout warnings name the copy's modules ("inner.up"); the real split repeats them with real paths
        "tensorshard.plans.validate": logging.ERROR,
    }
    levels = {name: get_logger(name).level for name in quieter}
    for name, level in quieter.items():
        get_logger(name).setLevel(level)
    try:
        yield
    finally:
        for name, level in levels.items():
            get_logger(name).setLevel(level)


def check_plan(module: nn.Module, plan: Plan, world_size: int, *, example_inputs: Any = None) -> Plan:
    """Self-check any plan (a preset, a hand-written one): regions that fail are replicated.

    Regions come from a trace of the model: the plan's entries for the layers of one traced group, with
    the Heads entry they use. Returns the plan itself when everything passes, else the plan with
    ``Replicate()`` entries in front for the failed regions (logged, one line each).
    """

    if world_size < 2:
        return plan
    assigned = plan.assign(module)
    split = {n: a for n, a in assigned.items() if not isinstance(a.style, (Replicate, Heads))}
    # Traced with the plan's own column layers as the only columns, so a group is one of the plan's pairs.
    columns = {n for n, a in split.items() if isinstance(a.style, ColwiseParallel) and not a.style.gather_output}
    fixed = {n for n, m in module.named_modules() if n not in split and layer_kind(m) is not None}
    run = lambda inputs, capture: trace_model(module, inputs, capture=capture, fixed=fixed, columns=columns)  # noqa: E731
    if example_inputs is not None:
        inputs = as_inputs(example_inputs)
    else:
        inputs = first_that_runs(module, lambda inputs: run(inputs, False))
    trace = run(inputs, True)
    regions = [[n for n in g.layers if n in split] for g in find_groups(trace)]
    grouped = {n for names in regions for n in names}
    regions += [[n] for n in split if n not in grouped and trace.captures.get(n) is not None]
    cache: dict = {}
    replicate: dict[str, Style] = {}
    for names in filter(None, regions):
        entries = {n: split[n].style for n in names}
        owners = {split[n].heads_owner for n in names} - {None}
        for owner in owners:
            entries[owner] = assigned[owner].style
        verdict = check_entries(module, trace, entries, world_size, cache)
        if verdict is not None:
            logger.warning("kept whole (self-check): %s: %s", ", ".join(names), verdict)
            for n in (owners or names):
                replicate[_relative(n, "")] = Replicate()
    return plan | replicate if replicate else plan
