"""Adapters PEFT added to a model after it was split: adopted so that they follow the split, or refused.

    split = tp.tensor_parallel(model, devices)        # or tp.parallelize(model, mesh)
    model = get_peft_model(split, LoraConfig(...))    # or PeftModel.from_pretrained(split, "adapter/")

PEFT then wraps each device's layers on its own (in one process every shard's, under torchrun this rank's):
each new adapter tensor is sized from its split base layer and holds that device's own random values, and
PEFT's forward would neither share the whole tensors nor sum the partial results. Adopting gives what PEFT
added (LoRA, DoRA and IA3 layers, a new adapter in an adopted layer, modules_to_save copies) what the plan
would have given it had it existed before splitting (adapter_plan.py): the same styles and the same split of
every tensor, with values that form one adapter. A tensor that stays whole takes the first device's values
everywhere (under torchrun: rank 0's, a broadcast); a split tensor keeps each device's slice (a row several
devices hold, of a replicated KV head, takes its first holder's); a DoRA magnitude is recomputed from the
adopted factors as PEFT initialises it, ||W + s B A|| per output row (the squared norms summed over the
devices beside a row-parallel layer). From then on the model trains exactly like an unsplit model holding
the same (gathered) adapter, and the split model knows the adapter's tensors by their unsplit names, so
gathered saves and unsplit loads work (after_split.py: PEFT's own ``save_pretrained`` and ``load_adapter``).

Each engine calls its adopter through engines/late_modules.py (late_in_process.py and late_torchrun.py register one each): before
every forward call, and in one process also before ``state_dict()`` / ``load_state_dict()``; PEFT's hook
(after_split.py) and transformers' ``add_adapter`` / ``load_adapter`` (transformers_adapters.py) call it as
soon as PEFT is done.

What was added, and how it must be split, is planned first, the same way for both engines, from one device's
module tree (`plan_late_adapters`; in one process the first shard, under torchrun this rank's module): wrappers
put in place of a layer (a LoRA or IA3 layer keeps the layer as ``.base_layer``, a modules_to_save wrapper as
``.original_module``) and new adapters in wrappers adopted before; for each new tensor, its split beside the
partition of the wrapped layer (the styles' ``beside``) and which styles to attach where; a modules_to_save copy
is split like the module it copies. Planning only reads, and checks everything before anything changes: what
cannot follow the split (a LoRA variant other than DoRA, another PEFT method's layer, an adapter on a layer split
some other way, modules_to_save on a module ZeRO-3 partitions, any other module added to the split model) is
refused with the fix, and PEFT's additions are taken out again (`take_out_late_adapters`), leaving the split
model as it was. Each engine then renames, makes the values one adapter, attaches the styles and keeps its own
bookkeeping:

- In one process (`adopt_in_process`, late_in_process.py): the adapter's whole trainable tensors are then partitioned ZeRO-3 style
  (engines/inprocess/zero.py), as they would be in a PeftModel split in training mode, so gradient clipping over
  ``model.parameters()`` (the Trainer's) counts each element once.
- Under torchrun (`adopt_under_torchrun`, late_torchrun.py, every rank at once: it is collective): each tensor is stored as a
  DTensor in its layout. While PEFT builds its layers, each layer sees the local slices of its base layer's
  weight (a DoRA magnitude starts from them), so that PEFT's own code never mixes DTensors with plain tensors
  (engines/torchrun/local_views.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from .recognised import is_adapter_layer, is_modules_to_save
from ...plans.module_shard import ModuleShard
from ...plans.plan import Plan
from ...plans.sharding import direct_tensors
from .adapter_plan import adapter_entries, base_kind
from .lora_styles import is_dora



# What was added and how it follows the split: the same for both engines, on one device's module tree.

@dataclass
class Wrapper:
    """One PEFT wrapper with something new inside, and what the plan did to the layer it wraps."""

    name: str
    fresh: bool  # PEFT put it there since the last adoption (else: an adopted one that gained an adapter)
    moved: str  # where the wrapped module went: "base_layer", or "original_module" (modules_to_save)
    base: ModuleShard | None = None  # what the plan did to the wrapped layer (None: left whole)


@dataclass
class LateAdapters:
    """PEFT's additions to a split model, and how they follow the split."""

    wrappers: dict[str, Wrapper] = field(default_factory=dict)
    tensors: dict[str, tuple[str, str]] = field(default_factory=dict)  # new tensor -> (owner module, wrapper)
    splits: dict[str, tuple | None] = field(default_factory=dict)  # new tensor -> split (None: whole)
    # module -> (style, its splits, the head groups of its layer, the name its collectives go by, its layer's balanced
    # plain sizes (plans/balance.py) or None)
    attach: dict[str, tuple] = field(default_factory=dict)

    def moved_name(self, name: str) -> str:
        """A name of the split model as it is once the fresh wrappers' wrapped modules have moved into them."""
        return moved_name(name, self.wrappers)


def plan_late_adapters(
    root: nn.Module,
    *,
    known: set[str],
    splits: dict,
    modules: dict[str, ModuleShard],
    zero: Callable[[str], bool] = lambda name: False,
    engine: str = "before tensor_parallel()",
    local_sizes: Callable[[LateAdapters, str], list[tuple[int, int]]] | None = None,
) -> LateAdapters:
    """PEFT's additions to `root` (one device's module tree) and how they follow the split.

    Args:
        known: the module names `root` had at the last look; `splits`: its tensors' splits by name; `modules`:
            what the plan did to each module (`ShardedModel.modules`, kept by the engine); `zero`: whether a
            tensor is held in ZeRO-3 pieces; `engine`: where to add the adapter instead, for messages;
            `local_sizes(late, name)`: (rank, size along the split dim) of new tensor `name` on each device this
            process holds, checked against its layer's slice (`check_local_sizes`).
    """
    named = dict(root.named_modules())
    late = LateAdapters()
    for name, module in named.items():
        moved = _moved_attr(module)
        if moved is not None and f"{name}.{moved}" not in known:
            late.wrappers[name] = Wrapper(name, True, moved)
    renamed = {moved_name(n, late.wrappers) for n in splits}
    stray = []
    for owner, mod in named.items():
        for _, attr, t in direct_tensors(mod):
            tname = f"{owner}.{attr}" if owner else attr
            if tname in renamed:
                continue
            wrapper = _wrapper_of(owner, named)
            if wrapper is None or wrapper[1]:
                stray.append(tname)
                continue
            if t.is_meta:
                raise NotImplementedError(f"{tname} is on the meta device (low_cpu_mem_usage=True?): add adapters to a "
                                          "split model with real tensors (low_cpu_mem_usage=False)")
            if wrapper[0] not in late.wrappers:  # adopted before, and given another adapter since
                late.wrappers[wrapper[0]] = Wrapper(wrapper[0], False, _moved_attr(named[wrapper[0]]))
            late.tensors[tname] = (owner, wrapper[0])
    stray += [n for n in named if n not in known and _wrapper_of(n, named) is None]
    if stray:
        raise NotImplementedError(
            f"{stray[0]}{f' and {len(stray) - 1} more' if len(stray) > 1 else ''} were added to the split model after "
            "splitting: only PEFT adapters (LoRA, DoRA, IA3, modules_to_save) can be added to a split model. Add "
            f"other modules {engine}"
        )
    for w in late.wrappers.values():
        _plan_wrapper(named, modules, zero, w, late, engine)
    if local_sizes is not None:
        check_local_sizes(late, lambda name: local_sizes(late, name))
    return late


def moved_name(name: str, wrappers: dict[str, Wrapper]) -> str:
    for w in wrappers.values():
        if w.fresh and (name == w.name or name.startswith(w.name + ".")):
            return f"{w.name}.{w.moved}{name[len(w.name):]}"
    return name


def rename_modules(modules: dict[str, ModuleShard], late: LateAdapters) -> None:
    """The plan's record of each module, under the names the fresh wrappers gave the modules they wrap."""
    for name, w in late.wrappers.items():
        if w.fresh:
            for old in [n for n in modules if n == name or n.startswith(name + ".")]:
                modules[f"{name}.{w.moved}{old[len(name):]}"] = modules.pop(old)


def check_local_sizes(late: LateAdapters, local_size: Callable[[str], list[tuple[int, int]]]) -> None:
    """Every new split tensor has its layer's slice: `local_size(name)` lists (rank, size along the split dim)."""
    for name, split in late.splits.items():
        if split is None:
            continue
        dim, part = split
        for rank, size in local_size(name):
            if size != part.local_size(rank):
                raise NotImplementedError(
                    f"{name} on rank {rank} has {size} entries along dim {dim}, not the {part.local_size(rank)} of its "
                    "layer's slice; add this adapter to the unsplit model before splitting"
                )


def _moved_attr(module: nn.Module | None) -> str | None:
    """Where a PEFT wrapper keeps the module it wraps; None for anything else."""
    if module is None:
        return None
    return "base_layer" if is_adapter_layer(module) else "original_module" if is_modules_to_save(module) else None


def _wrapper_of(name: str, modules: dict[str, nn.Module]) -> tuple[str, bool] | None:
    """(the nearest PEFT wrapper enclosing module `name`, itself included; whether `name` is inside the module it
    wraps), or None."""
    parts = name.split(".") if name else []
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        moved = _moved_attr(modules.get(candidate))
        if moved is not None:
            return candidate, parts[i:i + 1] == [moved]
    return None


def _plan_wrapper(named, modules, zero, w: Wrapper, late: LateAdapters, engine: str) -> None:
    wrapper = named[w.name]
    moved = w.name if w.fresh else f"{w.name}.{w.moved}"  # the wrapped module's name in `modules`, for now
    w.base = modules.get(moved)
    own = {t: owner for t, (owner, wr) in late.tensors.items() if wr == w.name}
    if w.moved == "original_module":
        _plan_copies(named, modules, zero, w, moved, late, engine)
        return
    if w.base is None or not w.base.splits:  # a layer the plan keeps whole: so is its adapter (PEFT's forward)
        if zero(f"{moved}.weight") and getattr(wrapper, "lora_magnitude_vector", None):
            raise NotImplementedError(
                f"{w.name}: DoRA on a layer whose weight ZeRO-3 partitions (its row norms need the whole weight). "
                f"Split with sharded=False, or add the adapter {engine}"
            )
        late.splits.update({t: None for t in own})
        return
    part = w.base.splits["weight"][1]
    styles = Plan(adapter_entries(w.name, wrapper, w.base.style))  # refuses what cannot follow the split
    for t, owner in own.items():
        match = styles.match(owner)
        style = match[1] if match is not None else None
        splits = style.beside(named[owner], part) if style is not None else {}
        late.splits[t] = splits.get(t.rsplit(".", 1)[1])
        if style is not None:
            late.attach[owner] = (style, splits, w.base.heads, owner, w.base.plain_sizes)
    if w.fresh:
        late.attach[w.name] = (styles[w.name], {}, w.base.heads, w.name, w.base.plain_sizes)


def _plan_copies(named, modules, zero, w: Wrapper, moved: str, late: LateAdapters, engine: str) -> None:
    """modules_to_save: each new copy (``<name>.modules_to_save.<adapter>``) is split like the module it copies."""
    prefix = f"{w.name}.modules_to_save."
    owners = {owner for owner, wr in late.tensors.values() if wr == w.name}
    for name, module in named.items():
        if not name.startswith(prefix):
            continue
        adapter, _, rest = name[len(prefix):].partition(".")
        copy = f"{prefix}{adapter}"
        if not any(o == copy or o.startswith(copy + ".") for o in owners):
            continue  # a copy adopted before
        original = f"{moved}.{rest}" if rest else moved
        ms = modules.get(original)
        for _, attr, _ in direct_tensors(module):
            if zero(f"{original}.{attr}"):
                raise NotImplementedError(
                    f"{w.name}: modules_to_save on a module whose parameters ZeRO-3 partitions ({original}.{attr}) "
                    f"cannot be added after splitting. Split with sharded=False, or add the adapter {engine}"
                )
            late.splits[f"{name}.{attr}"] = ms.splits.get(attr) if ms is not None else None
        if ms is not None:  # the copy's collectives go by the original's name (one layer, as the plan sees it)
            late.attach[name] = (ms.style, ms.splits, ms.heads, ms.name, ms.plain_sizes)


def take_out_late_adapters(root: nn.Module, known: set[str], splits: dict) -> None:
    """Undo what PEFT added to `root` since the last look: wrappers give their place back to the module they wrap,
    adapters added to adopted layers are deleted (PEFT's own ``delete_adapter``)."""
    for name, module in list(root.named_modules()):
        moved = _moved_attr(module)
        if moved is None or f"{name}.{moved}" in known:
            continue
        parent, _, child = name.rpartition(".")
        (root.get_submodule(parent) if parent else root)._modules[child] = getattr(module, moved)
    for name, module in root.named_modules():
        if not (is_adapter_layer(module) and hasattr(module, "delete_adapter")):
            continue
        added = {
            adapter
            for attr in getattr(module, "adapter_layer_names", ())
            for adapter in (getattr(module, attr, None) or {})
            if f"{name}.{attr}.{adapter}" not in known and not any(k.startswith(f"{name}.{attr}.{adapter}") for k in splits)
        }
        for adapter in sorted(added):
            module.delete_adapter(adapter)


def tensor_of(root: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer `name` below `root`, as its module holds it (not through a view or a forward)."""
    owner, _, attr = name.rpartition(".")
    module = root.get_submodule(owner) if owner else root
    return module._parameters[attr] if attr in module._parameters else module._buffers[attr]


def recompute_dora_magnitudes(
    late: LateAdapters,
    trees: list[nn.Module],
    local_weight: Callable[[str, nn.Module], torch.Tensor],
    sum_rows: Callable[[str, list[torch.Tensor]], list[torch.Tensor]],
) -> None:
    """Every DoRA magnitude PEFT initialised from one device's slices (`new_dora_magnitudes`), recomputed from the
    adopted factors: m = ||W + s B A|| per output row. `trees`: the module trees this process holds (in one process
    every device's shard, under torchrun this rank's module); `local_weight(name, layer)`: the base layer's weight
    as this device holds it; `sum_rows(name, squares)`: the squared row norms summed over the devices (beside a
    row-parallel layer each device holds part of every row; beside a column-parallel one, whole rows)."""
    for w, adapter in new_dora_magnitudes(late, trees[0]):
        layers = [tree.get_submodule(w.name) for tree in trees]
        squares = [dora_row_squares(layer, local_weight(w.name, layer), adapter) for layer in layers]
        if base_kind(w.base.style) == "row":
            squares = sum_rows(w.name, squares)
        for layer, sq in zip(layers, squares):
            set_dora_magnitude(layer, adapter, sq)


def new_dora_magnitudes(late: LateAdapters, root: nn.Module) -> Iterator[tuple[Wrapper, str]]:
    """(wrapper, adapter) for every DoRA magnitude in `late` beside a split layer: PEFT initialised it from one
    device's slice of the weight and that device's factors, so it is recomputed from the adopted ones. `root`:
    one device's module tree. (Beside a whole layer it takes the first device's values, as any whole tensor.)"""
    for w in late.wrappers.values():
        if w.moved != "base_layer" or w.base is None or not w.base.splits:
            continue
        layer = root.get_submodule(w.name)
        new = {owner for owner, wr in late.tensors.values() if wr == w.name}
        for adapter in list(getattr(layer, "lora_magnitude_vector", None) or {}):
            if f"{w.name}.lora_magnitude_vector.{adapter}" in new and is_dora(layer, adapter):
                yield w, adapter


def dora_row_squares(layer: nn.Module, weight: torch.Tensor, adapter: str) -> torch.Tensor:
    """PEFT's DoRA initialisation, m = ||W + s B A|| per output row, before the sum over devices and the square root:
    the squared row norms of this device's slices, in float32. `weight`: the base layer's local weight as stored
    ((out, in), or (in, out) with fan_in_fan_out). Beside a column-parallel layer a device holds whole rows (its
    sums are the norms' squares); beside a row-parallel one, part of every row (the engine sums over the devices)."""
    weight = weight.T if layer.fan_in_fan_out else weight  # (out_d, in_d)
    delta = layer.lora_B[adapter].weight @ layer.lora_A[adapter].weight  # (out_d, r) @ (r, in_d)
    return (weight.float() + layer.scaling[adapter] * delta.float()).pow(2).sum(dim=1)  # (out_d,)


def set_dora_magnitude(layer: nn.Module, adapter: str, squares: torch.Tensor) -> None:
    """m = the square root of the (summed) squared row norms, in m's dtype."""
    m = layer.lora_magnitude_vector[adapter].weight
    m.copy_(squares.sqrt().to(m.dtype))
