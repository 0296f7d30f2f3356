"""A model with PEFT adapters as a tensor_parallel config sees it: each adapted layer under its own name.

PEFT wraps an adapted layer (``q_proj``) and keeps the original inside it (``q_proj.base_layer``, or
``lm_head.original_module`` for ``modules_to_save``); the adapter's own modules (``q_proj.lora_A.default``) sit
beside it. A config's rules name the layer as the model without adapters does (``...q_proj.weight``), as they
did when the original package was written (PEFT then kept the weight at that name). The translator reads the
rules against this view: the wrapper's name with the original layer, tensors under their names without
``base_layer.`` / ``original_module.``, the adapters' modules and tensors left out. The plan it writes names the
wrapper, which the adapter rewrite (integrations/peft/adapter_plan.py, run when the plan is resolved) turns
into entries for the base layer and its adapters, each following the layer's split.
"""

from __future__ import annotations

import itertools
from typing import Iterator

import torch
from torch import nn

from ..layers import layer_wrapper, wrapped_layer
from ..plans.plan import Plan
from ..plans.rewriters import rewrite_plan

def bare_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) as the rules see them: a wrapper's name holds the layer it wraps; adapters are left out."""
    wrappers = _wrappers(model)
    out = []
    for name, module in model.named_modules():
        if _inside(name, wrappers) is None:
            out.append((name, _inner(module) if name in wrappers else module))
    return out


def bare_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and buffer, by first name as the rules see it; adapters' left out."""
    wrappers = _wrappers(model)
    out = []
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        bare = _bare_name(name, wrappers)
        if bare is not None:
            out.append((bare, t))
    return out


def adapted(model: nn.Module, plan: Plan) -> Plan:
    """The plan as the engine applies it: entries for wrappers rewritten for their layers and adapters."""
    return rewrite_plan(model, plan)


def _wrappers(model: nn.Module) -> dict[str, str]:
    """The layer wrappers' names (layers.py `register_layer_wrapper`: PEFT's), each with its wrapped layer's
    attribute."""
    return {n: w.inner for n, m in model.named_modules() if (w := layer_wrapper(m)) is not None}


def _inner(wrapper: nn.Module) -> nn.Module:
    return wrapped_layer(wrapper)


def _inside(name: str, wrappers: dict[str, str]) -> str | None:
    """The wrapper `name` lies strictly inside, if any."""
    return next((w for w in _prefixes(name) if w in wrappers and w != name), None)


def _prefixes(name: str) -> Iterator[str]:
    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        yield ".".join(parts[:depth])


def _bare_name(name: str, wrappers: dict[str, str]) -> str | None:
    """``...q_proj.base_layer.weight`` -> ``...q_proj.weight``; an adapter's tensor -> None."""
    wrapper = _inside(name, wrappers)
    if wrapper is None:
        return name
    rest = name[len(wrapper) + 1:] if wrapper else name
    head, _, tail = rest.partition(".")
    if head != wrappers[wrapper] or not tail:
        return None
    return f"{wrapper}.{tail}" if wrapper else tail
