"""Adapters added to a model after it was split: adopted so that they follow the split, or refused.

    model = tp.tensor_parallel(model, devices)
    model = get_peft_model(model, LoraConfig(...))          # or PeftModel.from_pretrained(model, "adapter/")

PEFT then wraps the layers of every shard separately: each device's adapter layer gets its own random
tensors, sized from its split base layer, and PEFT's forward would neither share the whole tensors nor sum
the partial results. `adopt_late_modules` finds what PEFT added (LoRA, DoRA and IA3 layers, a new adapter
in an existing layer, modules_to_save copies) and gives it what the plan would have given it had it existed
before splitting (plans/adapters.py): the same styles and the same split of every tensor, with values that
form one adapter. A tensor that stays whole takes the first device's values everywhere; a split tensor
keeps each device's slice (a row several devices hold, of a replicated KV head, takes its first holder's);
a DoRA magnitude is recomputed from the adopted factors as PEFT initialises it, ||W + s B A|| per output
row (summed over the devices beside a row-parallel layer). From then on the model trains exactly like an
unsplit model holding the same (gathered) adapter, and `splits` knows the adapter's tensors by their unsplit
names, so gathered saves and unsplit loads work (integrations/peft_after_split.py: PEFT's own
``save_pretrained`` and ``load_adapter``).

It runs when PEFT hands the split model to a PeftModel (integrations/peft_after_split.py), when transformers'
``add_adapter`` / ``load_adapter`` of a split model return, and otherwise before the next forward call,
state_dict() or load_state_dict(). Everything is checked before anything changes. What cannot follow the
split (a LoRA variant other than DoRA, another PEFT method's layer, an adapter on a layer split some other
way, modules_to_save on a module ZeRO-3 partitions, any other module added to the shards) is refused with
the fix, and PEFT's additions are taken out again, leaving the split model as it was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ...comm.dropout import ShardDropout, ThreadPeers, may_drop
from ...comm.threads import ThreadComm
from ...plans.adapters import adapter_entries, base_kind, is_adapter_layer, is_modules_to_save
from ...plans.plan import Plan
from ...plans.sharding import ModuleShard, direct_tensors
from ...styles.base import ShardContext
from ...styles.lora import is_dora
from .zero import shard_added

logger = logging.getLogger(__name__)


def module_count(model) -> int:
    """Modules and tensors of the first shard: a change means something was added since the last look."""
    shard = model.module_shards[0]
    return sum(1 + len(m._parameters) + len(m._buffers) for m in shard.modules())


@dataclass
class _Wrapper:
    """One PEFT wrapper with something new inside, and what the plan says about the layer it wraps."""

    name: str
    fresh: bool  # PEFT put it there since the last adoption (else: an adopted one that gained an adapter)
    moved: str  # where the wrapped module went: "base_layer", or "original_module" (modules_to_save)
    base: ModuleShard | None = None  # what the plan did to the wrapped layer (None: left whole)


@dataclass
class _Adoption:
    wrappers: dict[str, _Wrapper] = field(default_factory=dict)
    tensors: dict[str, tuple[str, str]] = field(default_factory=dict)  # new tensor -> (owner module, wrapper)
    splits: dict[str, tuple | None] = field(default_factory=dict)  # new tensor -> split (None: whole)
    # module -> (style, its splits, the head groups of its layer, the name its collectives go by)
    attach: dict[str, tuple] = field(default_factory=dict)


def adopt_late_modules(model) -> None:
    """Adopt what was added to `model`'s shards since splitting (see the module docstring); cheap when nothing was."""
    if module_count(model) == model._module_count:
        return
    try:
        adoption = _plan_adoption(model)  # every check, before any change
    except NotImplementedError:
        take_out_late_modules(model)
        raise
    with torch.no_grad():
        _rename_moved(model, adoption)
        _make_one_adapter(model, adoption)
    _attach(model, adoption)
    shard_added(model, _zero_candidates(model, adoption))
    partial = getattr(model._group, "partial_grads", None)
    if partial is not None:
        partial.install(model.module_shards)  # whole tensors with partial gradients: summed once per backward pass
    _consistent_dropout(model, adoption)
    model._module_names = {n for n, _ in model.module_shards[0].named_modules()}
    model._module_count = module_count(model)
    if adoption.tensors:
        logger.info("adopted %d adapter tensor(s) in %d layer(s) added after splitting; they follow their layers' "
                    "splits", len(adoption.tensors), len(adoption.wrappers))


# --- planning: what was added, and how it must be split -----------------------------------------------------


def _plan_adoption(model) -> _Adoption:
    modules = dict(model.module_shards[0].named_modules())
    known = model._module_names
    adoption = _Adoption()
    for name, module in modules.items():
        moved = _moved_attr(module)
        if moved is not None and f"{name}.{moved}" not in known:
            adoption.wrappers[name] = _Wrapper(name, True, moved)
    renamed = {_moved_name(n, adoption.wrappers) for n in model.splits}
    stray = []
    for owner, mod in modules.items():
        for _, attr, _ in direct_tensors(mod):
            tname = f"{owner}.{attr}" if owner else attr
            if tname in renamed:
                continue
            wrapper = _wrapper_of(owner, modules)
            if wrapper is None or wrapper[1]:
                stray.append(tname)
                continue
            if mod._parameters.get(attr) is not None and mod._parameters[attr].is_meta:
                raise NotImplementedError(f"{tname} is on the meta device (low_cpu_mem_usage=True?): add adapters to a "
                                          "split model with real tensors (low_cpu_mem_usage=False)")
            if wrapper[0] not in adoption.wrappers:  # adopted before, and given another adapter since
                adoption.wrappers[wrapper[0]] = _Wrapper(wrapper[0], False, _moved_attr(modules[wrapper[0]]))
            adoption.tensors[tname] = (owner, wrapper[0])
    stray += [n for n in modules if n not in known and _wrapper_of(n, modules) is None]
    if stray:
        raise NotImplementedError(
            f"modules were added to this split {type(model).__name__} after splitting ({stray[0]}"
            f"{f' and {len(stray) - 1} more' if len(stray) > 1 else ''}): only PEFT adapters (LoRA, DoRA, IA3, "
            "modules_to_save) can be added to a split model. Add other modules to the unsplit model before "
            "tensor_parallel()"
        )
    for w in adoption.wrappers.values():
        _plan_wrapper(model, modules, w, adoption)
    return adoption


def _moved_attr(module: nn.Module) -> str | None:
    """Where a PEFT wrapper keeps the module it wraps; None for anything else."""
    return "base_layer" if is_adapter_layer(module) else "original_module" if is_modules_to_save(module) else None


def _wrapper_of(name: str, modules: dict[str, nn.Module]) -> tuple[str, bool] | None:
    """(the nearest PEFT wrapper enclosing module `name`, itself included; whether `name` is inside the module
    it wraps), or None."""
    parts = name.split(".") if name else []
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        moved = _moved_attr(modules.get(candidate)) if candidate in modules else None
        if moved is not None:
            return candidate, parts[i:i + 1] == [moved]
    return None


def _moved_name(name: str, wrappers: dict[str, _Wrapper]) -> str:
    """A name in the split model as it is once the fresh wrappers' wrapped modules have moved into them."""
    for w in wrappers.values():
        if w.fresh and (name == w.name or name.startswith(w.name + ".")):
            return f"{w.name}.{w.moved}{name[len(w.name):]}"
    return name


def _plan_wrapper(model, modules: dict[str, nn.Module], w: _Wrapper, adoption: _Adoption) -> None:
    wrapper = modules[w.name]
    layout = model._layout_modules
    moved = w.name if w.fresh else f"{w.name}.{w.moved}"  # the wrapped module's name in the layout, for now
    w.base = layout.get(moved)
    zero = getattr(model, "zero_splits", None) or {}
    own = {t: owner for t, (owner, wr) in adoption.tensors.items() if wr == w.name}
    if w.moved == "original_module":
        _plan_copies(w, modules, moved, layout, zero, adoption)
        return
    if w.base is None or not w.base.splits:  # a layer the plan keeps whole: so is its adapter (PEFT's forward)
        if f"{moved}.weight" in zero and getattr(wrapper, "lora_magnitude_vector", None):
            raise NotImplementedError(
                f"{w.name}: DoRA on a layer whose weight ZeRO-3 partitions (its row norms need the whole weight). "
                "Split with sharded=False, or add the adapter before tensor_parallel()"
            )
        adoption.splits.update({t: None for t in own})
        return
    part = w.base.splits.get("weight", (None, None))[1]
    styles = Plan(adapter_entries(w.name, wrapper, w.base.style))  # refuses what cannot follow the split
    for t, owner in own.items():
        style = styles.match(owner)[1] if styles.match(owner) is not None else None
        splits = style.beside(modules[owner], part) if style is not None else {}
        adoption.splits[t] = splits.get(t.rsplit(".", 1)[1])
        if style is not None:
            adoption.attach[owner] = (style, splits, w.base.heads, owner)
    if w.fresh:
        adoption.attach[w.name] = (styles[w.name], {}, w.base.heads, w.name)
    for t in own:
        _check_local_shapes(model, t, adoption.splits[t])


def _plan_copies(w: _Wrapper, modules, moved: str, layout, zero, adoption: _Adoption) -> None:
    """modules_to_save: each copy (``<name>.modules_to_save.<adapter>``) is split like the module it copies."""
    held = [n for n in zero if n == moved or n.startswith(moved + ".")]
    if held:
        raise NotImplementedError(
            f"{w.name}: modules_to_save on a module whose parameters ZeRO-3 partitions ({held[0]}) cannot be added "
            "after splitting. Split with sharded=False, or add the adapter before tensor_parallel()"
        )
    prefix = f"{w.name}.modules_to_save."
    for name, module in modules.items():
        if not name.startswith(prefix):
            continue
        adapter, _, rest = name[len(prefix):].partition(".")
        if f"{prefix}{adapter}" not in {o for o, _ in adoption.tensors.values()} and not any(
                o.startswith(f"{prefix}{adapter}.") for o, _ in adoption.tensors.values()):
            continue  # a copy adopted before
        ms = layout.get(f"{moved}.{rest}" if rest else moved)
        for _, attr, _ in direct_tensors(module):
            adoption.splits[f"{name}.{attr}"] = ms.splits.get(attr) if ms is not None else None
        if ms is not None:  # the copy's collectives go by the original's name (one layer, as the plan sees it)
            adoption.attach[name] = (ms.style, ms.splits, ms.heads, ms.name)


def _check_local_shapes(model, name: str, split) -> None:
    if split is None:
        return
    dim, part = split
    for rank, shard in enumerate(model.module_shards):
        size = _tensor(shard, name).shape[dim]
        if size != part.local_size(rank):
            raise NotImplementedError(
                f"{name} on device {rank} has {size} entries along dim {dim}, not the {part.local_size(rank)} of its "
                "layer's slice; add this adapter to the unsplit model before tensor_parallel()"
            )


# --- applying it ---------------------------------------------------------------------------------------------


def _rename_moved(model, adoption: _Adoption) -> None:
    """The wrapped modules' tensors, plan entries and ZeRO-3 partitions under their new names."""
    fresh = {n: w for n, w in adoption.wrappers.items() if w.fresh}
    model.splits = {_moved_name(n, fresh): s for n, s in model.splits.items()}
    zero = getattr(model, "zero_splits", None)
    if zero:
        model.zero_splits = {_moved_name(n, fresh): s for n, s in zero.items()}
    layout = model._layout_modules
    for name, w in fresh.items():
        for old in [n for n in layout if n == name or n.startswith(name + ".")]:
            layout[f"{name}.{w.moved}{old[len(name):]}"] = layout.pop(old)
    model.splits.update(adoption.splits)


def _make_one_adapter(model, adoption: _Adoption) -> None:
    """Values that form one adapter: whole tensors from the first device, replicated rows from their first holder,
    DoRA magnitudes recomputed from the adopted factors."""
    shards = list(model.module_shards)
    first = model._placement[0]
    for name, split in adoption.splits.items():
        local = [_tensor(s, name) for s in shards]
        if split is None:
            for t in local[1:]:
                t.copy_(local[0].to(t.device))
        elif split[1].overlapping:
            dim, part = split
            whole = part.assemble([t.to(first) for t in local], dim)
            for rank, t in enumerate(local):
                t.copy_(part.take(whole, dim, rank).to(t.device))
    for w in adoption.wrappers.values():
        if w.moved == "base_layer" and w.base is not None:  # (beside a whole layer every device took the first's)
            _recompute_magnitudes(model, w, adoption)


def _recompute_magnitudes(model, w: _Wrapper, adoption: _Adoption) -> None:
    """PEFT's DoRA initialisation, m = ||W + s B A|| per output row, on the adopted factors (summed over the
    devices' column slices beside a row-parallel layer)."""
    layers = [s.get_submodule(w.name) for s in model.module_shards]
    new = {adoption.tensors[t][0] for t in adoption.tensors if adoption.tensors[t][1] == w.name}
    for adapter in list(getattr(layers[0], "lora_magnitude_vector", None) or {}):
        if f"{w.name}.lora_magnitude_vector.{adapter}" not in new or not is_dora(layers[0], adapter):
            continue
        squares = []
        for layer in layers:
            weight = layer.get_base_layer().weight
            weight = weight.T if layer.fan_in_fan_out else weight
            delta = layer.lora_B[adapter].weight @ layer.lora_A[adapter].weight
            squares.append((weight.float() + layer.scaling[adapter] * delta.float()).pow(2).sum(dim=1))
        if base_kind(w.base.style) == "row":  # each device holds part of every row
            total = sum(s.to(squares[0].device) for s in squares)
            squares = [total.to(s.device) for s in squares]
        for layer, sq in zip(layers, squares):
            m = layer.lora_magnitude_vector[adapter].weight
            m.copy_(sq.sqrt().to(m.dtype))


def _attach(model, adoption: _Adoption) -> None:
    world = len(model.module_shards)
    if world == 1:
        return
    for rank, shard in enumerate(model.module_shards):
        comm = ThreadComm(model._group, rank)
        for name, (style, splits, heads, where) in adoption.attach.items():
            module = shard.get_submodule(name)
            module.__dict__.pop("forward", None)  # a modules_to_save copy runs its own forward, not the original's
            style.attach(module, splits, ShardContext(rank=rank, world_size=world, name=where, comm=comm, heads=heads))


def _zero_candidates(model, adoption: _Adoption) -> list[str]:
    """The new tensors ZeRO-3 partitions, as it would have at split time when training (zero.py): trainable
    whole parameters with at least as many rows as devices. Gradient clipping over ``model.parameters()`` (the
    Trainer's) then counts each of their elements once."""
    world = len(model.module_shards)
    shard = model.module_shards[0]
    out = []
    for name, split in adoption.splits.items():
        t = _tensor(shard, name)
        if split is None and isinstance(t, nn.Parameter) and t.requires_grad and t.dim() >= 1 and t.shape[0] >= world:
            out.append(name)
    return out


def _consistent_dropout(model, adoption: _Adoption) -> None:
    """Adapters with dropout draw one mask per replicated activation on every device (comm/dropout.py)."""
    if len(model.module_shards) == 1:
        return
    wrappers = [[s.get_submodule(n) for s in model.module_shards] for n in adoption.wrappers]
    if not any(may_drop(ws[0]) for ws in wrappers):
        return
    if model._dropout is None:
        model._dropout = ShardDropout(ThreadPeers(model._group))
        model._dropout.install(model.module_shards)
        return
    for ws in wrappers:
        model._dropout.install(ws)


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    mod = module.get_submodule(owner) if owner else module
    return mod._parameters[attr] if attr in mod._parameters else mod._buffers[attr]


# --- refusing: PEFT's additions taken out again --------------------------------------------------------------


def take_out_late_modules(model) -> None:
    """Undo what PEFT added to the shards since the last adoption: wrappers give their place back to the module
    they wrap, adapters added to adopted layers are deleted. The split model is left as it was."""
    known = model._module_names
    for shard in model.module_shards:
        modules = dict(shard.named_modules())
        for name, module in modules.items():
            moved = "base_layer" if is_adapter_layer(module) else "original_module" if is_modules_to_save(module) else None
            if moved is None or f"{name}.{moved}" in known:
                continue
            parent, _, child = name.rpartition(".")
            (shard.get_submodule(parent) if parent else shard)._modules[child] = getattr(module, moved)
    for shard in model.module_shards:
        for name, module in shard.named_modules():
            if is_adapter_layer(module) and hasattr(module, "delete_adapter"):
                for adapter in _new_adapters(module, name, model):
                    module.delete_adapter(adapter)
    model._module_count = module_count(model)


def _new_adapters(layer: nn.Module, name: str, model) -> list[str]:
    names = set()
    for attr in getattr(layer, "adapter_layer_names", ()):
        container = getattr(layer, attr, None)
        for adapter in container or {}:
            if f"{name}.{attr}.{adapter}" not in model._module_names and not any(
                    k.startswith(f"{name}.{attr}.{adapter}") for k in model.splits):
                names.add(adapter)
    return sorted(names)
