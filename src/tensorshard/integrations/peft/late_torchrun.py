"""Adopting adapters PEFT added to a module parallelized under torchrun: this rank's module, every rank together.

The plan of what was added, and the refusals, are late_adapters.py's (the same for both engines); this file
renames, broadcasts what stays whole, stores each tensor as a DTensor in its layout and attaches the styles.
Registered with engines/late_modules.py for the torchrun engine. While PEFT builds its layers on the parallelized
module (after_split.py), `building_views` shows it this rank's plain slices; the adoption puts the DTensors back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...comm.process_group import gather_partition
from ...comm.dist_guard import collective
from ...comm.dtensor import Layout, mesh_device
from ...engines.late_modules import register_adopter
from ...engines.torchrun.local_views import swap_local_views, swap_wrapper_views
from ...logs import get_logger
from ...registrations import count_modules_and_tensors, nothing_added, registrations
from ...styles.style import ShardContext
from .late_adapters import (
    LateAdapters, plan_late_adapters, recompute_dora_magnitudes, rename_modules, take_out_late_adapters, tensor_of,
)

logger = get_logger(__name__)


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
    swap_wrapper_views(root, state, names=set(late.wrappers))  # what they read of their base layers
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
    for name, (style, splits, heads, where, sizes) in late.attach.items():
        ctx = ShardContext(rank=state.comm.rank, world_size=world, name=where, comm=state.comm, heads=heads, plain_sizes=sizes)
        style.attach(root.get_submodule(name), splits, ctx)


register_adopter("torchrun", adopt_under_torchrun)


# While PEFT adds adapter layers to a parallelized module (after_split.py), and until they are adopted.

def building_views(root: nn.Module, state) -> None:
    """While PEFT adds adapter layers to the parallelized `root`: every DTensor parameter is replaced by a plain
    parameter holding this rank's slice (PEFT's code reads base weights with plain tensors beside them: DoRA's
    row norms). `restore_after_building` puts the DTensors back (the engine does, before adopting)."""
    if state.building:
        return
    for name, module in root.named_modules():
        for attr, t in list(module._parameters.items()):
            key = f"{name}.{attr}" if name else attr
            if isinstance(t, DTensor) and key in state.layouts:
                stand_in = nn.Parameter(state.layouts[key].view(t.to_local().detach()), requires_grad=t.requires_grad)
                state.building.append((module, attr, t, stand_in))
                module._parameters[attr] = stand_in


def restore_after_building(state) -> None:
    """The DTensors back in place of `building_views`' stand-ins, with the trainable flags PEFT gave those."""
    for module, attr, original, stand_in in state.building:
        if module._parameters.get(attr) is stand_in:
            module._parameters[attr] = original
        original.requires_grad_(stand_in.requires_grad)
    state.building = []
