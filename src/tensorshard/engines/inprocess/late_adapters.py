"""Adapters added to a model after it was split: adopted so they follow the split, or refused.

    model = tp.tensor_parallel(model, devices)
    model = get_peft_model(model, LoraConfig(...))          # or PeftModel.from_pretrained(model, "adapter/")

PEFT then wraps the layers of every shard separately: each device's LoRA layer gets its own random
factors, sized from the split base layer, and PEFT's forward would neither share A (column-parallel base)
nor sum the partial results (row-parallel base). Before the next forward call, state_dict() or
load_state_dict() of the split model, `adopt_late_modules` finds such modules and applies the styles the
plan would have given them had they existed before splitting (styles/lora.py): the factors that stay whole
take shard 0's values on every device, the split ones keep each device's slice. From then on the model
trains exactly like an unsplit model holding the same (gathered) adapter.

Saving: PEFT finds adapter tensors by module name, and here those names are the shards'
(``module_shards.N...``): its ``save_pretrained`` would write an adapter no unsplit model loads, so a
parent's ``state_dict()`` is refused with the fix. ``tensorshard.integrations.transformers.save_adapter`` writes
PEFT's format with the unsplit names and shapes. For the same reason ``PeftModel.from_pretrained(split_model,
...)`` is refused: load the adapter before splitting.

Refused, with the fix: any other module added after splitting (``modules_to_save`` copies would run
the original's forward; unknown layers cannot be split consistently), and LoRA variants the styles do not
support. Adding adapters before splitting is the cheaper path: saving then gathers only the adapter.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ...comm.threads import ThreadComm
from ...plans.adapters import factor_styles, is_adapter_layer
from ...styles.base import ShardContext
from ...styles.lora import LoraParallel, lora_layer_problem

logger = logging.getLogger(__name__)


def module_count(model) -> int:
    return sum(1 for _ in model.module_shards[0].modules())


def adopt_late_modules(model) -> None:
    """Adopt adapters added to `model`'s shards since splitting (see the module docstring); cheap when none were."""
    if module_count(model) == model._module_count:
        return
    shards = list(model.module_shards)
    known = model._module_names
    added = [n for n, _ in shards[0].named_modules() if n not in known]
    new = set(added)  # PEFT puts its layer at the wrapped layer's name, which moves to .base_layer
    layers = [n for n, m in shards[0].named_modules() if is_adapter_layer(m) and f"{n}.base_layer" in new]
    stray = [n for n in added if not any(n == x or n.startswith(x + ".") for x in layers)]
    if stray:
        raise NotImplementedError(
            f"modules were added to this split {type(model).__name__} after splitting ({stray[0]}"
            f"{f' and {len(stray) - 1} more' if len(stray) > 1 else ''}): only LoRA adapters can be added to a split "
            "model. Add them to the unsplit model before tensor_parallel() (get_peft_model(model, config), then split)"
        )
    plans = {n: _plan_for(model, n, shards[0].get_submodule(n)) for n in layers}  # every check before any change
    with torch.no_grad():
        for name, (base, part) in plans.items():
            _adopt(model, name, base, part)
    partial = getattr(model._group, "partial_grads", None)
    if partial is not None:
        partial.install(model.module_shards)  # the whole factors' gradients: summed once per backward pass
    model._module_names = {n for n, _ in shards[0].named_modules()}
    model._module_count = module_count(model)
    model._late_adapters = True
    logger.info("adopted %d adapter layer(s) added after splitting; they follow their base layers' splits", len(layers))


def _plan_for(model, name: str, layer: nn.Module):
    """(base kind or None for a whole layer, partition) for the adapter layer at `name`, or a clear error."""
    problem = lora_layer_problem(layer)
    if problem is not None:
        raise NotImplementedError(
            f"{name}: {problem} was added after splitting and cannot follow the split of its layer. Use plain LoRA, "
            "or add the adapter to the unsplit model before tensor_parallel()"
        )
    split = model.splits.get(f"{name}.weight")
    if split is None:
        return None, None
    dim, part = split
    style = model.plan.match(name)
    kind = "column" if dim == 0 and not getattr(style[1], "gather_output", False) else "row" if dim == 1 else None
    if kind is None or part.overlapping:
        raise NotImplementedError(
            f"{name} is split by {style[1].describe() if style else 'the plan'}; a LoRA adapter added after splitting "
            "cannot follow that split. Leave it out of target_modules, or add the adapter before tensor_parallel()"
        )
    return kind, part


def _adopt(model, name: str, base: str | None, part) -> None:
    shards = list(model.module_shards)
    world = len(shards)
    layers = [s.get_submodule(name) for s in shards]
    whole = (lambda f: True) if base is None else (lambda f: f == ("lora_A" if base == "column" else "lora_B"))
    for factor in ("lora_A", "lora_B"):
        if whole(factor):  # the same values on every device: shard 0's
            for layer in layers[1:]:
                for adapter, module in getattr(layer, factor).items():
                    for p, src in zip(module.parameters(), getattr(layers[0], factor)[adapter].parameters()):
                        p.copy_(src.to(p.device))
    # The split model's original names: the base layer's tensors moved under .base_layer; the factors' splits.
    for attr in ("weight", "bias"):
        if f"{name}.{attr}" in model.splits:
            model.splits[f"{name}.base_layer.{attr}"] = model.splits.pop(f"{name}.{attr}")
    for adapter in layers[0].lora_A:
        a, b = f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight"
        model.splits[a] = (1, part) if base == "row" else None
        model.splits[b] = (0, part) if base == "column" else None
        if layers[0].lora_B[adapter].bias is not None:
            model.splits[b.removesuffix("weight") + "bias"] = model.splits[b]
    if base is None or world == 1:
        return
    styles = dict(zip(("lora_A", "lora_B"), factor_styles(base)))
    for rank, layer in enumerate(layers):
        comm = ThreadComm(model._group, rank)
        for factor, style in styles.items():
            for adapter, module in getattr(layer, factor).items():
                where = f"{name}.{factor}.{adapter}"
                ctx = ShardContext(rank=rank, world_size=world, name=where, comm=comm)
                splits = {} if style.split.startswith("whole") else {"weight": (0 if factor == "lora_B" else 1, part)}
                style.attach(module, splits, ctx)
        LoraParallel(base=base).attach(layer, {}, ShardContext(rank=rank, world_size=world, name=name, comm=comm))


def refuse_parent_state_dict(model) -> None:
    """A parent module (the PeftModel around the split model) asks for the state dict: PEFT would name the
    adapter's tensors after each device's shard (``module_shards.N...``), which no unsplit model loads."""
    adopt_late_modules(model)
    if model._late_adapters:
        raise NotImplementedError(
            "PEFT cannot save or load the adapter of a model split before the adapter was added: it names the "
            "tensors after each device's shard (module_shards.N...), which an unsplit model would not load. Save it "
            "with tensorshard.integrations.transformers.save_adapter(peft_model, folder) (PEFT's format, unsplit names), and "
            "add adapters before splitting from now on: tp.tensor_parallel(get_peft_model(model, config), devices) "
            "or tp.tensor_parallel(PeftModel.from_pretrained(model, folder), devices)"
        )
