"""PEFT adapters added to a module after `parallelize`: adopted so that they follow the split, or refused.

    model = tp.parallelize(AutoModelForCausalLM.from_pretrained(...), mesh)
    model = get_peft_model(model, LoraConfig(...))       # or PeftModel.from_pretrained(model, "adapter/")

PEFT wraps this rank's layers, which hold DTensors: each new adapter tensor is a plain tensor sized from the
layer's local slice, with this rank's own random values, and PEFT's forward would neither share the whole
tensors nor sum the partial results. `adopt_late_adapters` (every rank at once: it is collective) gives
them what `parallelize` would have given them had they existed before (plans/adapters.py): the same styles,
each tensor stored as a DTensor in the same layout, with values that form one adapter: whole tensors take
rank 0's values (a broadcast), split ones keep each rank's slice (rows of a replicated KV head take their
first holder's), and a DoRA magnitude is recomputed from the adopted factors, ||W + s B A|| per output
row (the squared norms summed over the ranks beside a row-parallel layer), as PEFT initialises it.

It runs when PEFT hands the module to a PeftModel (integrations/peft_after_split.py) and otherwise at the
next forward call (a collective: every rank calls forward). Everything is checked before anything changes;
what cannot follow the split is refused with the fix and PEFT's additions are taken out again. While PEFT
builds its layers, each layer sees the local slices of its base layer's weight (a DoRA magnitude starts
from them), so that PEFT's own code never mixes DTensors with plain tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...comm.dist import gather_partition
from ...comm.dist_guard import collective
from ...comm.dtensor import Layout, mesh_device
from ...plans.adapters import adapter_entries, base_kind, is_adapter_layer, is_modules_to_save
from ...plans.plan import Plan
from ...plans.sharding import ModuleShard, direct_tensors
from ...styles.base import ShardContext
from ...styles.lora import is_dora
from .local_views import restore_after_building, swap_adapter_layers, swap_local_views

logger = logging.getLogger(__name__)


def module_count(root: nn.Module) -> int:
    """Modules and tensors of `root`: a change means something was added since the last look."""
    return sum(1 + len(m._parameters) + len(m._buffers) for m in root.modules())


@dataclass
class _Wrapper:
    name: str
    fresh: bool  # PEFT put it there since the last adoption (else: an adopted one that gained an adapter)
    moved: str  # where the wrapped module went: "base_layer", or "original_module" (modules_to_save)
    base: ModuleShard | None = None


@dataclass
class _Adoption:
    wrappers: dict[str, _Wrapper] = field(default_factory=dict)
    tensors: dict[str, tuple[str, str]] = field(default_factory=dict)  # new tensor -> (owner module, wrapper)
    splits: dict[str, tuple | None] = field(default_factory=dict)  # new tensor -> split (None: whole)
    attach: dict[str, tuple] = field(default_factory=dict)  # module -> (style, splits, heads, name for collectives)


def adopt_late_adapters(root: nn.Module) -> None:
    """Adopt what PEFT added to the parallelized `root` since `parallelize` (see the module docstring). Every
    rank of the tensor-parallel group must call it together; cheap when nothing was added."""
    state = root.tensorshard
    restore_after_building(state)
    if module_count(root) == state.module_count:
        return
    try:
        adoption = _plan(root, state)
    except NotImplementedError:
        take_out_late_adapters(root)
        raise
    with torch.no_grad():
        _rename_moved(state, adoption)
        _make_one_adapter(root, state, adoption)
        held = _as_dtensors(root, state, adoption)
    _attach(root, state, adoption)
    for module, tensors in held.items():
        swap_local_views(module, tensors, state)  # after attach: outermost, and partial gradients are known
    swap_adapter_layers(root, state, names=set(adoption.wrappers))  # what they read of their base layers
    state.module_names = {n for n, _ in root.named_modules()}
    state.module_count = module_count(root)
    if adoption.tensors and dist.get_rank() == 0:
        logger.info("adopted %d adapter tensor(s) in %d layer(s) added after parallelize; they follow their "
                    "layers' splits", len(adoption.tensors), len(adoption.wrappers))


# --- planning -------------------------------------------------------------------------------------------------


def _moved_attr(module: nn.Module | None) -> str | None:
    return "base_layer" if is_adapter_layer(module) else "original_module" if is_modules_to_save(module) else None


def _wrapper_of(name: str, modules: dict[str, nn.Module]) -> tuple[str, bool] | None:
    parts = name.split(".") if name else []
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        moved = _moved_attr(modules.get(candidate)) if candidate in modules else None
        if moved is not None:
            return candidate, parts[i:i + 1] == [moved]
    return None


def _moved_name(name: str, wrappers: dict[str, _Wrapper]) -> str:
    for w in wrappers.values():
        if w.fresh and (name == w.name or name.startswith(w.name + ".")):
            return f"{w.name}.{w.moved}{name[len(w.name):]}"
    return name


def _plan(root: nn.Module, state) -> _Adoption:
    modules = dict(root.named_modules())
    known = state.module_names
    adoption = _Adoption()
    for name, module in modules.items():
        moved = _moved_attr(module)
        if moved is not None and f"{name}.{moved}" not in known:
            adoption.wrappers[name] = _Wrapper(name, True, moved)
    renamed = {_moved_name(n, adoption.wrappers) for n in state.splits}
    stray = []
    for owner, mod in modules.items():
        for _, attr, t in direct_tensors(mod):
            tname = f"{owner}.{attr}" if owner else attr
            if tname in renamed:
                continue
            wrapper = _wrapper_of(owner, modules)
            if wrapper is None or wrapper[1]:
                stray.append(tname)
                continue
            if t.is_meta:
                raise NotImplementedError(f"{tname} is on the meta device (low_cpu_mem_usage=True?): create adapters "
                                          "on a parallelized model with real tensors (low_cpu_mem_usage=False)")
            if wrapper[0] not in adoption.wrappers:
                adoption.wrappers[wrapper[0]] = _Wrapper(wrapper[0], False, _moved_attr(modules[wrapper[0]]))
            adoption.tensors[tname] = (owner, wrapper[0])
    stray += [n for n in modules if n not in known and _wrapper_of(n, modules) is None]
    if stray:
        raise NotImplementedError(
            f"{stray[0]}{f' and {len(stray) - 1} more' if len(stray) > 1 else ''} were added to this module after "
            "parallelize(): only PEFT adapters (LoRA, DoRA, IA3, modules_to_save) can be added to a parallelized "
            "model. Add other modules before tp.parallelize()"
        )
    for w in adoption.wrappers.values():
        _plan_wrapper(modules, state, w, adoption)
    return adoption


def _plan_wrapper(modules, state, w: _Wrapper, adoption: _Adoption) -> None:
    wrapper = modules[w.name]
    moved = w.name if w.fresh else f"{w.name}.{w.moved}"
    w.base = state.modules.get(moved)
    own = {t: owner for t, (owner, wr) in adoption.tensors.items() if wr == w.name}
    if w.moved == "original_module":  # modules_to_save: each copy split like the module it copies
        prefix = f"{w.name}.modules_to_save."
        owners = {o for o in own.values()}
        for name, module in modules.items():
            if not name.startswith(prefix):
                continue
            adapter, _, rest = name[len(prefix):].partition(".")
            if not any(o == f"{prefix}{adapter}" or o.startswith(f"{prefix}{adapter}.") for o in owners):
                continue  # a copy adopted before
            ms = state.modules.get(f"{moved}.{rest}" if rest else moved)
            for _, attr, _ in direct_tensors(module):
                adoption.splits[f"{name}.{attr}"] = ms.splits.get(attr) if ms is not None else None
            if ms is not None:
                adoption.attach[name] = (ms.style, ms.splits, ms.heads, ms.name)
        return
    if w.base is None or not w.base.splits:  # a layer the plan keeps whole: so is its adapter (PEFT's forward)
        adoption.splits.update({t: None for t in own})
        return
    part = w.base.splits["weight"][1]
    styles = Plan(adapter_entries(w.name, wrapper, w.base.style))  # refuses what cannot follow the split
    for t, owner in own.items():
        match = styles.match(owner)
        style = match[1] if match is not None else None
        splits = style.beside(modules[owner], part) if style is not None else {}
        adoption.splits[t] = splits.get(t.rsplit(".", 1)[1])
        if style is not None:
            adoption.attach[owner] = (style, splits, w.base.heads, owner)
    if w.fresh:
        adoption.attach[w.name] = (styles[w.name], {}, w.base.heads, w.name)
    rank = state.comm.rank
    for t in own:
        split = adoption.splits[t]
        if split is not None and _tensor(modules, t).shape[split[0]] != split[1].local_size(rank):
            raise NotImplementedError(
                f"{t} has {_tensor(modules, t).shape[split[0]]} entries along dim {split[0]} on rank {rank}, not the "
                f"{split[1].local_size(rank)} of its layer's slice; add this adapter before tp.parallelize()"
            )


# --- applying -------------------------------------------------------------------------------------------------


def _rename_moved(state, adoption: _Adoption) -> None:
    fresh = {n: w for n, w in adoption.wrappers.items() if w.fresh}
    state.splits = {_moved_name(n, fresh): s for n, s in state.splits.items()}
    state.layouts = {_moved_name(n, fresh): s for n, s in state.layouts.items()}
    for name, w in fresh.items():
        for old in [n for n in state.modules if n == name or n.startswith(name + ".")]:
            state.modules[f"{name}.{w.moved}{old[len(name):]}"] = state.modules.pop(old)
    state.splits.update(adoption.splits)


def _make_one_adapter(root: nn.Module, state, adoption: _Adoption) -> None:
    """Whole tensors from rank 0, replicated rows from their first holder, DoRA magnitudes recomputed."""
    group, device = state.comm.group, mesh_device(state.mesh)
    modules = dict(root.named_modules())
    source = dist.get_global_rank(group, 0)
    for name, split in adoption.splits.items():
        t = _tensor(modules, name)
        if isinstance(t, DTensor):
            continue  # a modules_to_save copy of DTensors: already this rank's slice in its layout
        if split is None:
            data = t.detach().to(device).contiguous()
            collective(dist.broadcast, data, data, src=source, group=group, what=f"broadcast of {name} (adapter adopted)")
            t.copy_(data)
        elif split[1].overlapping:
            dim, part = split
            whole = gather_partition(t.detach().to(device).contiguous(), dim, part, group)
            t.copy_(part.take(whole, dim, state.comm.rank))
    for w in adoption.wrappers.values():
        if w.moved == "base_layer" and w.base is not None and w.base.splits:
            _recompute_magnitudes(modules, state, w, adoption)


def _recompute_magnitudes(modules, state, w: _Wrapper, adoption: _Adoption) -> None:
    layer = modules[w.name]
    new = {owner for owner, wr in adoption.tensors.values() if wr == w.name}
    for adapter in list(getattr(layer, "lora_magnitude_vector", None) or {}):
        if f"{w.name}.lora_magnitude_vector.{adapter}" not in new or not is_dora(layer, adapter):
            continue
        weight = layer.get_base_layer().weight
        weight = weight.to_local() if hasattr(weight, "to_local") else weight
        layout = state.layouts.get(f"{w.name}.base_layer.weight")
        weight = layout.view(weight) if layout is not None and layout.dim is not None else weight
        weight = weight.T if layer.fan_in_fan_out else weight
        delta = layer.lora_B[adapter].weight @ layer.lora_A[adapter].weight
        squares = (weight.float() + layer.scaling[adapter] * delta.float()).pow(2).sum(dim=1).contiguous()
        if base_kind(w.base.style) == "row":  # each rank holds part of every row
            collective(dist.all_reduce, squares, squares, group=state.comm.group, what=f"{w.name} (DoRA row norms)")
        m = layer.lora_magnitude_vector[adapter].weight
        m.copy_(squares.sqrt().to(m.dtype))


def _as_dtensors(root: nn.Module, state, adoption: _Adoption) -> dict[nn.Module, dict]:
    """Each new tensor as the DTensor its layout says; {module: {(kind, name): layout}} for the local views."""
    modules = dict(root.named_modules())
    held: dict[nn.Module, dict] = {}
    rank, device = state.comm.rank, mesh_device(state.mesh)
    for name, split in adoption.splits.items():
        owner, _, attr = name.rpartition(".")
        module = modules[owner]
        kind = "param" if attr in module._parameters else "buffer"
        t = module._parameters[attr] if kind == "param" else module._buffers[attr]
        layout = Layout.of(split, rank)
        state.layouts[name] = layout
        local = t.detach() if isinstance(t, DTensor) else layout.to_dtensor(t.detach().to(device).contiguous(), state.mesh)
        if kind == "param":
            module._parameters[attr] = nn.Parameter(local, requires_grad=t.requires_grad)
            held.setdefault(module, {})[(kind, attr)] = layout
        elif split is not None:
            module._buffers[attr] = local
            held.setdefault(module, {})[(kind, attr)] = layout
    return held


def _attach(root: nn.Module, state, adoption: _Adoption) -> None:
    world = state.comm.world_size
    modules = dict(root.named_modules())
    for name, module in modules.items():  # a modules_to_save copy runs its own forward, not the original's
        if any(w.moved == "original_module" and name.startswith(f"{w.name}.modules_to_save.") for w in adoption.wrappers.values()):
            module.__dict__.pop("forward", None)
    if world == 1:
        return
    for name, (style, splits, heads, where) in adoption.attach.items():
        module = modules[name]
        style.attach(module, splits, ShardContext(rank=state.comm.rank, world_size=world, name=where,
                                                  comm=state.comm, heads=heads))


def _tensor(modules: dict[str, nn.Module], name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    module = modules[owner]
    return module._parameters[attr] if attr in module._parameters else module._buffers[attr]


# --- refusing -------------------------------------------------------------------------------------------------


def take_out_late_adapters(root: nn.Module) -> None:
    """Undo what PEFT added since the last adoption: wrappers give their place back to the module they wrap,
    adapters added to adopted layers are deleted. The module is left as it was."""
    state = root.tensorshard
    known = state.module_names
    for name, module in list(root.named_modules()):
        moved = _moved_attr(module)
        if moved is None or f"{name}.{moved}" in known:
            continue
        parent, _, child = name.rpartition(".")
        (root.get_submodule(parent) if parent else root)._modules[child] = getattr(module, moved)
    for name, module in root.named_modules():
        if not (is_adapter_layer(module) and hasattr(module, "delete_adapter")):
            continue
        for attr in getattr(module, "adapter_layer_names", ()):
            for adapter in list(getattr(module, attr, None) or {}):
                if f"{name}.{attr}.{adapter}" not in known and not any(k.startswith(f"{name}.{attr}.{adapter}") for k in state.splits):
                    module.delete_adapter(adapter)
    state.module_count = module_count(root)
