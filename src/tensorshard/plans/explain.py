"""What a plan does to a model, module by module, before anything is split: `explain(model, plan, n)`.

For every module that holds parameters or gets a style: the style, each parameter's local shape on each
device, the parameter bytes per device, and the collectives the style runs, per token, with the bytes each
device receives. The costs are arithmetic on the plan and the shapes (no forward pass, so a model on the
meta device works), following what the styles do:

    ColwiseParallel   backward: all-reduce of its input gradient (in_features per token), once per input
                      tensor: columns reading the same tensor (q, k, v) share it; gather_output adds a
                      forward all-gather of out_features
    RowwiseParallel   forward: all-reduce of out_features
    EmbeddingParallel forward: all-reduce of embedding_dim (vocab split) or all-gather (embedding split)
    SumGradients          backward: all-reduce of its parameters' gradients, once per step
    ColwiseParallel on replicated KV heads: backward all-reduce of the shared weight rows, once per step

Sharing between columns comes from a trace of the model (the one plan inference made, or a new one);
without it every column is counted on its own. Convolutions count one spatial position as a token.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import quant
from ..layers import layer_kind
from ..styles import ColwiseParallel, EmbeddingParallel, RowwiseParallel, ShardParams, SumGradients
from .plan import Plan
from .balance import check_balance
from .sharding import direct_tensors, shard_plan

Cost = tuple[str, int]  # (collective, bytes per device)


@dataclass
class ModuleRow:
    name: str
    type: str
    style: str
    shapes: list[str]  # "weight (1024|1024, 4096)": local shape, per-device sizes joined by |
    bytes_per_device: list[int]
    forward: list[Cost] = field(default_factory=list)  # per token
    backward: list[Cost] = field(default_factory=list)  # per token
    per_step: list[Cost] = field(default_factory=list)  # once per optimizer step (gradients of weights)


@dataclass
class Explanation:
    world_size: int
    rows: list[ModuleRow]
    whole_bytes: int  # parameters and buffers of the unsplit model

    @property
    def bytes_per_device(self) -> list[int]:
        return [sum(r.bytes_per_device[d] for r in self.rows) for d in range(self.world_size)]

    def totals(self, phase: str) -> Counter:
        """{collective: count} and {collective + ' bytes': bytes} per token for 'forward' / 'backward'."""
        out: Counter = Counter()
        for r in self.rows:
            for kind, nbytes in getattr(r, phase):
                out[kind] += 1
                out[f"{kind} bytes"] += nbytes
        return out


def explain(
    module: nn.Module, plan: Plan, world_size: int, *, trace=None, dtype: torch.dtype | None = None,
    balance: bool = False,
) -> Explanation:
    """Per-module shapes, memory and communication of `plan` on `module` over `world_size` devices.

    `trace`: a `plans.trace.Trace` of the model, for which columns share an input; `dtype`: the element type
    of activations (default: each layer's weight dtype); `balance`: the sizes of a balanced split, as
    `tensor_parallel(..., balance=True)` makes it (plans/balance.py).
    """
    sharded = shard_plan(module, plan, world_size, balance=check_balance(balance))
    shared_inputs = _shared_inputs(trace)
    seen_inputs: set[int] = set()
    rows: list[ModuleRow] = []
    whole = 0
    first_name: dict[int, str] = {}  # a tied tensor (embedding and head) is held, and counted, once
    for name, mod in module.named_modules():
        tensors = [(tname, t) for _, tname, t in direct_tensors(mod)]
        ms = sharded.modules.get(name)
        if not tensors and ms is None:
            continue
        per_device = [0] * world_size
        shapes = []
        for tname, t in tensors:
            if id(t) in first_name:
                shapes.append(f"{tname}: tied to {first_name[id(t)]}")
                continue
            first_name[id(t)] = f"{name}.{tname}" if name else tname
            whole += quant.stored_bytes(t)
            split = ms.splits.get(tname) if ms is not None else None
            shape = quant.logical_shape(t)  # (out, in) for a packed 4-bit weight too
            if split is None:
                shapes.append(f"{tname} {_shape(shape)}")
                for d in range(world_size):
                    per_device[d] += quant.stored_bytes(t)
                continue
            dim, part = split
            sizes = [part.local_size(r) for r in range(world_size)]
            dims = [str(s) for s in shape]
            dims[dim] = "|".join(str(s) for s in sizes) if len(set(sizes)) > 1 else str(sizes[0])
            shapes.append(f"{tname} ({', '.join(dims)})")
            for d in range(world_size):
                per_device[d] += quant.stored_bytes(t, shape[:dim] + (sizes[d],) + shape[dim + 1:])
        row = ModuleRow(name or "<model>", type(mod).__name__, ms.style.describe() if ms else "-", shapes, per_device)
        if ms is not None and world_size > 1:
            _costs(row, mod, ms, world_size, dtype, shared_inputs, seen_inputs)
        rows.append(row)
    return Explanation(world_size, rows, whole)


def _costs(row: ModuleRow, mod: nn.Module, ms, world: int, dtype, shared: dict[str, int], seen: set[int]) -> None:
    style, kind = ms.style, layer_kind(mod)
    weight = getattr(mod, "weight", None)
    elem = (torch.tensor([], dtype=dtype) if dtype is not None else weight if weight is not None else torch.tensor([])).element_size()
    if isinstance(style, ColwiseParallel) and kind is not None:
        in_f, out_f = weight.shape[kind.weight_in_dim], weight.shape[kind.weight_out_dim]
        key = shared.get(ms.name)
        if key is None or key not in seen:
            row.backward.append(("all_reduce", in_f * elem))
            if key is not None:
                seen.add(key)
        if style.gather_output:
            row.forward.append(("all_gather", out_f * elem))
        dim, part = ms.splits["weight"]
        if part.overlapping:
            tied = sum(part.local_size(r) for r in range(world)) - part.size
            row.per_step.append(("all_reduce", tied * weight.numel() // weight.shape[dim] * weight.element_size()))
    elif isinstance(style, RowwiseParallel) and kind is not None:
        row.forward.append(("all_reduce", weight.shape[kind.weight_out_dim] * elem))
    elif isinstance(style, EmbeddingParallel):
        dim = weight.shape[1]
        row.forward.append(("all_reduce" if style.split == "vocab" else "all_gather", dim * elem))
    elif isinstance(style, SumGradients):
        for p in mod.parameters(recurse=False):
            if p.requires_grad:
                row.per_step.append(("all_reduce", p.numel() * p.element_size()))
    elif isinstance(style, ShardParams):  # sizes depend on the module's own inputs: unknown here
        if style.output == "partial":
            row.forward.append(("all_reduce", -1))
        if style.input == "replicate":
            row.backward.append(("all_reduce", -1))


def _shared_inputs(trace) -> dict[str, int]:
    """Column layer -> a key shared by the columns that read the same tensor in the traced pass."""
    if trace is None:
        return {}
    out = {}
    for name, info in trace.layers.items():
        calls = [c for c in info.calls if c.role == "column"]
        if calls:
            out[name] = calls[0].input_id
    return out


def _shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def human_bytes(n: float) -> str:
    if n < 0:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
