"""Adapters PEFT added to a model after it was split: adopted so that they follow the split, or refused.

    split = tp.tensor_parallel(model, devices)        # or tp.parallelize(model, mesh)
    model = get_peft_model(split, LoraConfig(...))    # or PeftModel.from_pretrained(split, "adapter/")

PEFT then wraps each device's layers on its own (in one process every shard's, under torchrun this rank's):
each new adapter tensor is sized from its split base layer and holds that device's own random values, and
PEFT's forward would neither share the whole tensors nor sum the partial results. Adopting gives what PEFT
added (LoRA, DoRA and IA3 layers, a new adapter in an adopted layer, modules_to_save copies) what the plan
would have given it had it existed before splitting (plans/adapters.py): the same styles and the same split of
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
soon as PEFT is done. What was added, and how it must be split, is planned first, for both engines alike, and
everything is checked before anything changes: what cannot follow the split (a LoRA variant other than DoRA,
another PEFT method's layer, an adapter on a layer split some other way, modules_to_save on a module ZeRO-3
partitions, any other module added to the split model) is refused with the fix, and PEFT's additions are taken
out again, leaving the split model as it was.

- In one process (`adopt_in_process`): the adapter's whole trainable tensors are then partitioned ZeRO-3 style
  (engines/inprocess/zero.py), as they would be in a PeftModel split in training mode, so gradient clipping over
  ``model.parameters()`` (the Trainer's) counts each element once.
- Under torchrun (`adopt_under_torchrun`, every rank at once: it is collective): each tensor is stored as a
  DTensor in its layout. While PEFT builds its layers, each layer sees the local slices of its base layer's
  weight (a DoRA magnitude starts from them), so that PEFT's own code never mixes DTensors with plain tensors
  (engines/torchrun/local_views.py).
"""

from __future__ import annotations

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
from ...logs import get_logger
from ...plans import late_adapters as late_plan
from ...plans.late_adapters import LateAdapters, tensor_of
from ...registrations import count_modules_and_tensors, nothing_added, registrations
from ...styles.style import ShardContext

logger = get_logger(__name__)


# In one process: every shard of a TensorParallel (or of the split model a view belongs to) at once.

def adopt_in_process(model) -> None:
    """Adopt what was added to `model`'s shards since splitting (see the module docstring); cheap when nothing was."""
    root = root_of(model)
    if root is not model:  # a view never adopts on its own: its split model does, then the view follows (views.py)
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
        late_plan.take_out_late_adapters(shard, model._module_names, model.splits)
    model._module_count = count_modules_and_tensors(model.module_shards[0])


def _plan_in_process(model) -> LateAdapters:
    zero = getattr(model, "zero_splits", None) or {}
    shards = list(model.module_shards)
    return late_plan.plan_late_adapters(
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
    late_plan.rename_modules(model._layout_modules, late)
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
    beside a row-parallel layer (plans/late_adapters.py)."""

    def summed(_name: str, squares: list[torch.Tensor]) -> list[torch.Tensor]:
        total = sum(s.to(squares[0].device) for s in squares)
        return [total.to(s.device) for s in squares]

    def local_weight(_name: str, layer: nn.Module) -> torch.Tensor:
        return layer.get_base_layer().weight

    late_plan.recompute_dora_magnitudes(late, list(model.module_shards), local_weight, summed)


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
    """The new tensors ZeRO-3 partitions, as it would at split time when training (zero.py): trainable whole
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
