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

Each engine calls its adopter through engines/late_modules.py (registered at the end of this file): before
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

- In one process (`adopt_in_process`): the adapter's whole trainable tensors are then partitioned ZeRO-3 style
  (engines/inprocess/zero.py), as they would be in a PeftModel split in training mode, so gradient clipping over
  ``model.parameters()`` (the Trainer's) counts each element once.
- Under torchrun (`adopt_under_torchrun`, every rank at once: it is collective): each tensor is stored as a
  DTensor in its layout. While PEFT builds its layers, each layer sees the local slices of its base layer's
  weight (a DoRA magnitude starts from them), so that PEFT's own code never mixes DTensors with plain tensors
  (engines/torchrun/local_views.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...comm.dist import gather_partition
from ...comm.dist_guard import collective
from ...comm.dropout import ShardDropout, ThreadPeers, may_drop
from ...comm.dtensor import Layout, mesh_device
from ...comm.threads import ThreadComm
from ...engines.inprocess.views import follow_root, root_of
from ...engines.inprocess.zero import shard_added
from ...engines.late_modules import register_adopter
from ...engines.torchrun.local_views import restore_after_building, swap_adapter_layers, swap_local_views
from ...layers import is_adapter_layer, is_modules_to_save
from ...logs import get_logger
from ...plans.module_shard import ModuleShard
from ...plans.plan import Plan
from ...plans.sharding import direct_tensors
from ...registrations import count_modules_and_tensors, nothing_added, registrations
from ...styles.style import ShardContext
from .adapter_plan import adapter_entries, base_kind
from .lora_styles import is_dora

logger = get_logger(__name__)


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
    # module -> (style, its splits, the head groups of its layer, the name its collectives go by)
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
            late.attach[owner] = (style, splits, w.base.heads, owner)
    if w.fresh:
        late.attach[w.name] = (styles[w.name], {}, w.base.heads, w.name)


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
            late.attach[name] = (ms.style, ms.splits, ms.heads, ms.name)


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


# In one process: every shard of a TensorParallel (or of the split model a view belongs to) at once.

def adopt_in_process(model) -> None:
    """Adopt what was added to `model`'s shards since splitting (see the module docstring); cheap when nothing was."""
    root = root_of(model)
    # a view never adopts on its own: its split model does, then the view follows (engines/inprocess/views.py)
    if root is not model:
        adopt_in_process(root)
        follow_root(model)
        return
    seen = nothing_added(model.module_shards[0], model.__dict__.get("_registrations"), model._module_count)
    if seen is not None:
        model._registrations = seen
        return
    try:
        late = _plan_in_process(model)  # every check, before any change
    except NotImplementedError:
        _take_out_in_process(model)
        raise
    with torch.no_grad():
        _rename_moved(model, late)
        _make_one_adapter_in_process(model, late)
    _attach_in_process(model, late)
    shard_added(model, _zero_candidates(model, late))
    partial = getattr(model._group, "partial_grads", None)
    if partial is not None:
        partial.install(model.module_shards)  # whole tensors with partial gradients: summed once per backward pass
    _consistent_dropout(model, late)
    model._module_names = {n for n, _ in model.module_shards[0].named_modules()}
    model._module_count = count_modules_and_tensors(model.module_shards[0])
    model._registrations = registrations()  # only now: an adoption that failed half-way is looked at again
    if late.tensors:
        logger.info("adopted %d adapter tensor(s) in %d layer(s) added after splitting; they follow their layers' "
                    "splits", len(late.tensors), len(late.wrappers))


def _take_out_in_process(model) -> None:
    """Undo what PEFT added to the shards since the last adoption; the split model is left as it was."""
    for shard in model.module_shards:
        take_out_late_adapters(shard, model._module_names, model.splits)
    model._module_count = count_modules_and_tensors(model.module_shards[0])


def _plan_in_process(model) -> LateAdapters:
    zero = getattr(model, "zero_splits", None) or {}
    shards = list(model.module_shards)
    return plan_late_adapters(
        shards[0], known=model._module_names, splits=model.splits, modules=model._layout_modules,
        zero=zero.__contains__, engine="before tensor_parallel()",
        local_sizes=lambda late, name: [(r, tensor_of(s, name).shape[late.splits[name][0]]) for r, s in enumerate(shards)],
    )


def _rename_moved(model, late: LateAdapters) -> None:
    """The wrapped modules' tensors, plan records and ZeRO-3 partitions under their new names; the new tensors' splits."""
    model.splits = {late.moved_name(n): s for n, s in model.splits.items()}
    zero = getattr(model, "zero_splits", None)
    if zero:
        model.zero_splits = {late.moved_name(n): s for n, s in zero.items()}
    rename_modules(model._layout_modules, late)
    model.splits.update(late.splits)


def _make_one_adapter_in_process(model, late: LateAdapters) -> None:
    """Values that form one adapter: whole tensors from the first device, replicated rows from their first holder,
    DoRA magnitudes recomputed from the adopted factors."""
    shards = list(model.module_shards)
    first = model._placement[0]
    for name, split in late.splits.items():
        local = [tensor_of(s, name) for s in shards]
        if split is None:
            for t in local[1:]:
                t.copy_(local[0].to(t.device))
        elif split[1].overlapping:
            dim, part = split
            whole = part.assemble([t.to(first) for t in local], dim)
            for rank, t in enumerate(local):
                t.copy_(part.take(whole, dim, rank).to(t.device))
    _recompute_magnitudes_in_process(model, late)


def _recompute_magnitudes_in_process(model, late: LateAdapters) -> None:
    """DoRA magnitudes from the adopted factors, the squared row norms summed over the devices' column slices
    beside a row-parallel layer (`recompute_dora_magnitudes`)."""

    def summed(_name: str, squares: list[torch.Tensor]) -> list[torch.Tensor]:
        total = sum(s.to(squares[0].device) for s in squares)
        return [total.to(s.device) for s in squares]

    def local_weight(_name: str, layer: nn.Module) -> torch.Tensor:
        return layer.get_base_layer().weight

    recompute_dora_magnitudes(late, list(model.module_shards), local_weight, summed)


def _attach_in_process(model, late: LateAdapters) -> None:
    world = len(model.module_shards)
    if world == 1:
        return
    for rank, shard in enumerate(model.module_shards):
        comm = ThreadComm(model._group, rank)
        for name, (style, splits, heads, where) in late.attach.items():
            module = shard.get_submodule(name)
            module.__dict__.pop("forward", None)  # a modules_to_save copy runs its own forward, not the original's
            style.attach(module, splits, ShardContext(rank=rank, world_size=world, name=where, comm=comm, heads=heads))


def _zero_candidates(model, late: LateAdapters) -> list[str]:
    """The new tensors ZeRO-3 partitions, as it would at split time when training (engines/inprocess/zero.py): trainable whole
    parameters with at least as many rows as devices."""
    world = len(model.module_shards)
    shard = model.module_shards[0]
    out = []
    for name, split in late.splits.items():
        t = tensor_of(shard, name)
        if split is None and isinstance(t, nn.Parameter) and t.requires_grad and t.dim() >= 1 and t.shape[0] >= world:
            out.append(name)
    return out


def _consistent_dropout(model, late: LateAdapters) -> None:
    """Adapters with dropout draw one mask per replicated activation on every device (comm/dropout.py)."""
    if len(model.module_shards) == 1:
        return
    wrappers = [[s.get_submodule(n) for s in model.module_shards] for n in late.wrappers]
    if not any(may_drop(ws[0]) for ws in wrappers):
        return
    if model._dropout is None:
        model._dropout = ShardDropout(ThreadPeers(model._group))
        model._dropout.install(model.module_shards)
        return
    for ws in wrappers:
        model._dropout.install(ws)


# Under torchrun: this rank's module; every rank of the tensor-parallel group calls together.

def adopt_under_torchrun(root: nn.Module) -> None:
    """Adopt what PEFT added to the parallelized `root` since `parallelize` (see the module docstring). Every
    rank of the tensor-parallel group must call it together; cheap when nothing was added."""
    state = root.tensorshard
    restore_after_building(state)
    seen = nothing_added(root, state.registrations, state.module_count)
    if seen is not None:
        state.registrations = seen
        return
    try:
        late = plan_late_adapters(
            root, known=state.module_names, splits=state.splits, modules=state.modules, engine="before tp.parallelize()",
            local_sizes=lambda late, name: [(state.comm.rank, tensor_of(root, name).shape[late.splits[name][0]])],
        )
    except NotImplementedError:
        take_out_late_adapters(root, state.module_names, state.splits)
        state.module_count = count_modules_and_tensors(root)
        raise
    with torch.no_grad():
        state.splits = {late.moved_name(n): s for n, s in state.splits.items()}
        state.layouts = {late.moved_name(n): s for n, s in state.layouts.items()}
        rename_modules(state.modules, late)
        state.splits.update(late.splits)
        _make_one_adapter_under_torchrun(root, state, late)
        held = _as_dtensors(root, state, late)
    _attach_under_torchrun(root, state, late)
    for module, tensors in held.items():
        swap_local_views(module, tensors, state)  # after attach: outermost, and partial gradients are known
    swap_adapter_layers(root, state, names=set(late.wrappers))  # what they read of their base layers
    state.module_names = {n for n, _ in root.named_modules()}
    state.module_count = count_modules_and_tensors(root)
    state.registrations = registrations()  # only now: an adoption that failed half-way is looked at again
    if late.tensors and dist.get_rank() == 0:
        logger.info("adopted %d adapter tensor(s) in %d layer(s) added after parallelize; they follow their "
                    "layers' splits", len(late.tensors), len(late.wrappers))


def _make_one_adapter_under_torchrun(root: nn.Module, state, late: LateAdapters) -> None:
    """Whole tensors from rank 0, replicated rows from their first holder, DoRA magnitudes recomputed."""
    group, device = state.comm.group, mesh_device(state.mesh)
    source = dist.get_global_rank(group, 0)
    for name, split in late.splits.items():
        t = tensor_of(root, name)
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
    _recompute_magnitudes_under_torchrun(root, state, late)


def _recompute_magnitudes_under_torchrun(root: nn.Module, state, late: LateAdapters) -> None:
    """DoRA magnitudes from the adopted factors, the squared row norms all-reduced over the ranks beside a
    row-parallel layer (`recompute_dora_magnitudes`)."""

    def local_weight(name: str, layer: nn.Module) -> torch.Tensor:
        weight = layer.get_base_layer().weight
        weight = weight.to_local() if isinstance(weight, DTensor) else weight
        layout = state.layouts.get(f"{name}.base_layer.weight")
        return layout.view(weight) if layout is not None and layout.dim is not None else weight  # this rank's slice

    def summed(name: str, squares: list[torch.Tensor]) -> list[torch.Tensor]:
        (mine,) = squares
        mine = mine.contiguous()
        collective(dist.all_reduce, mine, mine, group=state.comm.group, what=f"{name} (DoRA row norms)")
        return [mine]

    recompute_dora_magnitudes(late, [root], local_weight, summed)


def _as_dtensors(root: nn.Module, state, late: LateAdapters) -> dict[nn.Module, dict]:
    """Each new tensor as the DTensor its layout says; {module: {(kind, name): layout}} for the local views."""
    held: dict[nn.Module, dict] = {}
    rank, device = state.comm.rank, mesh_device(state.mesh)
    for name, split in late.splits.items():
        owner, _, attr = name.rpartition(".")
        module = root.get_submodule(owner)
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


def _attach_under_torchrun(root: nn.Module, state, late: LateAdapters) -> None:
    world = state.comm.world_size
    copies = [f"{w.name}.modules_to_save." for w in late.wrappers.values() if w.moved == "original_module"]
    for name, module in root.named_modules():  # a modules_to_save copy runs its own forward, not the original's
        if any(name.startswith(prefix) for prefix in copies):
            module.__dict__.pop("forward", None)
    if world == 1:
        return
    for name, (style, splits, heads, where) in late.attach.items():
        ctx = ShardContext(rank=state.comm.rank, world_size=world, name=where, comm=state.comm, heads=heads)
        style.attach(root.get_submodule(name), splits, ctx)


register_adopter("inprocess", adopt_in_process)
register_adopter("torchrun", adopt_under_torchrun)
