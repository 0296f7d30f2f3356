"""Adopting adapters PEFT added to an in-process split model: every shard of a TensorParallel at once.

The plan of what was added, and the refusals, are late_adapters.py's (the same for both engines); this file
renames, makes the values one adapter across the shards, attaches the styles and partitions the whole trainable
tensors ZeRO-3 style (engines/inprocess/zero.py). Registered with engines/late_modules.py for the in-process engine.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm.dropout import ShardDropout, ThreadPeers, may_drop
from ...comm.threads import ThreadComm
from ...engines.inprocess.views import follow_root, root_of
from ...engines.inprocess.zero import shard_added
from ...engines.late_modules import register_adopter
from ...logs import get_logger
from ...registrations import count_modules_and_tensors, nothing_added, registrations
from ...styles.style import ShardContext
from .late_adapters import (
    LateAdapters, plan_late_adapters, recompute_dora_magnitudes, rename_modules, take_out_late_adapters, tensor_of,
)

logger = get_logger(__name__)


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
        for name, (style, splits, heads, where, sizes) in late.attach.items():
            module = shard.get_submodule(name)
            module.__dict__.pop("forward", None)  # a modules_to_save copy runs its own forward, not the original's
            # its comm bound to the layer's name, as at split time (engines/inprocess/build.py)
            ctx = ShardContext(rank=rank, world_size=world, name=where, comm=comm.at(where), heads=heads, plain_sizes=sizes)
            style.attach(module, splits, ctx)


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


register_adopter("inprocess", adopt_in_process)
