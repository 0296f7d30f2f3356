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

It runs when PEFT hands the module to a PeftModel (integrations/peft/after_split.py) and otherwise at the
next forward call (a collective: every rank calls forward). What was added and how it must be split comes
from plans/late_adapters.py, which checks everything before anything changes: what cannot follow the split
is refused with the fix and PEFT's additions are taken out again. While PEFT
builds its layers, each layer sees the local slices of its base layer's weight (a DoRA magnitude starts
from them), so that PEFT's own code never mixes DTensors with plain tensors (local_views.py).
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...comm.process_group import gather_partition
from ...comm.dist_guard import collective
from ...comm.dtensor import Layout, mesh_device
from ...logs import get_logger
from ...plans import late_adapters as late_plan
from ...plans.late_adapters import LateAdapters, tensor_of
from ...registrations import count_modules_and_tensors, nothing_added, registrations
from ...styles.style import ShardContext
from .local_views import restore_after_building, swap_adapter_layers, swap_local_views

logger = get_logger(__name__)


def adopt_late_adapters(root: nn.Module) -> None:
    """Adopt what PEFT added to the parallelized `root` since `parallelize` (see the module docstring). Every
    rank of the tensor-parallel group must call it together; cheap when nothing was added."""
    state = root.tensorshard
    restore_after_building(state)
    seen = nothing_added(root, state.registrations, state.module_count)
    if seen is not None:
        state.registrations = seen
        return
    try:
        late = late_plan.plan_late_adapters(
            root, known=state.module_names, splits=state.splits, modules=state.modules, engine="before tp.parallelize()",
            local_sizes=lambda late, name: [(state.comm.rank, tensor_of(root, name).shape[late.splits[name][0]])],
        )
    except NotImplementedError:
        late_plan.take_out_late_adapters(root, state.module_names, state.splits)
        state.module_count = count_modules_and_tensors(root)
        raise
    with torch.no_grad():
        state.splits = {late.moved_name(n): s for n, s in state.splits.items()}
        state.layouts = {late.moved_name(n): s for n, s in state.layouts.items()}
        late_plan.rename_modules(state.modules, late)
        state.splits.update(late.splits)
        _make_one_adapter(root, state, late)
        held = _as_dtensors(root, state, late)
    _attach(root, state, late)
    for module, tensors in held.items():
        swap_local_views(module, tensors, state)  # after attach: outermost, and partial gradients are known
    swap_adapter_layers(root, state, names=set(late.wrappers))  # what they read of their base layers
    state.module_names = {n for n, _ in root.named_modules()}
    state.module_count = count_modules_and_tensors(root)
    state.registrations = registrations()  # only now: an adoption that failed half-way is looked at again
    if late.tensors and dist.get_rank() == 0:
        logger.info("adopted %d adapter tensor(s) in %d layer(s) added after parallelize; they follow their "
                    "layers' splits", len(late.tensors), len(late.wrappers))


def _make_one_adapter(root: nn.Module, state, late: LateAdapters) -> None:
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
    _recompute_magnitudes(root, state, late)


def _recompute_magnitudes(root: nn.Module, state, late: LateAdapters) -> None:
    """DoRA magnitudes from the adopted factors, the squared row norms all-reduced over the ranks beside a
    row-parallel layer (plans/late_adapters.py)."""

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

    late_plan.recompute_dora_magnitudes(late, [root], local_weight, summed)


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


def _attach(root: nn.Module, state, late: LateAdapters) -> None:
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

