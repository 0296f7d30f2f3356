"""The `tensor_parallel` package's hand-loading helpers: split a state dict yourself, place it yourself.

    with accelerate.init_empty_weights():
        model = tp.TensorParallel(MyModel(), device_ids=[0, 1])
    tp_state_dict = tp.convert_state_dict(state_dict, tensor_parallel_config=model.tensor_parallel_config,
                                          world_size=len(model.devices))
    device_map = tp.infer_sharded_device_map(model)
    for name, tensor in tp_state_dict.items():
        accelerate.utils.set_module_tensor_to_device(model, name, device_map[name], value=tensor)

`convert_state_dict` turns (part of) an unsplit state dict into ``module_shards.<rank>.<name>`` slices
(views where that costs nothing, copies where two devices would otherwise share memory);
`infer_sharded_device_map` maps those names (and every module name) to the devices. The layout comes from
``model.tensor_parallel_config``: the model's plan, bound to the model (`BoundPlan`).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from ..plans import resolve_plan
from ..plans.plan import BoundPlan, Plan
from ..plans.sharding import shard_plan
from .layout import is_split_model, placements
from .sources import describe_names


def convert_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    plan: Plan | dict | None = None,
    world_size: int | None = None,
    *,
    tensor_parallel_config: Plan | dict | None = None,
    model: nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """Split (part of) an unsplit model's state dict into ``module_shards.<rank>.<name>`` tensors.

    The layout comes from `model` (a TensorParallel model, or the unsplit module, possibly on the meta
    device, with `plan` and `world_size`), or from ``model.tensor_parallel_config`` passed as the plan.
    Split tensors become views of the input where no two devices share memory; replicated tensors are
    copied for every device but the first. Memory: at most one more copy of the replicated tensors given.
    """
    if plan is not None and tensor_parallel_config is not None:
        raise ValueError("pass either plan= or tensor_parallel_config= (its old name), not both")
    plan = plan if plan is not None else tensor_parallel_config
    if model is None and isinstance(plan, BoundPlan):
        model = plan.model
        if model is None:
            raise ValueError("the model this plan came from no longer exists; pass model=...")
    if model is None and is_split_model(plan):
        model, plan = plan, None
    if model is None:
        raise ValueError(
            "convert_state_dict needs the model's layout: pass tensor_parallel_config=model.tensor_parallel_config "
            "(from a TensorParallel model), or model=<the unsplit module, e.g. built on the meta device> with plan= "
            "and world_size="
        )
    where, world = _layout_of(model, plan, world_size)
    unknown = [n for n in state_dict if n not in where]
    if unknown:
        raise ValueError(
            f"{len(unknown)} key(s) of the state dict are not tensors of the model: {describe_names(unknown)}. "
            "Rename them to the model's state-dict names first."
        )
    out: dict[str, torch.Tensor] = {}
    for rank in range(world):
        for name, tensor in state_dict.items():
            placement = where[name]
            if placement is None:
                local = tensor if rank == 0 else tensor.clone()
            else:
                dim, part = placement
                if tensor.shape[dim] != part.size:
                    raise ValueError(
                        f"{name}: shape {tuple(tensor.shape)} has {tensor.shape[dim]} along dim {dim}; the model has {part.size}"
                    )
                local = part.take(tensor, dim, rank)
                if part.overlapping and rank > 0 and len(part.ranges[rank]) == 1:
                    local = local.clone()  # a KV head held by several devices: each needs its own copy
            out[f"module_shards.{rank}.{name}"] = local
    return out


def _layout_of(model: nn.Module, plan, world_size: int | None):
    if is_split_model(model):
        if world_size is not None and world_size != model.world_size:
            raise ValueError(f"world_size={world_size}, but the model is split over {model.world_size} devices")
        return placements(model), model.world_size
    if plan is None or world_size is None:
        raise ValueError("with an unsplit model=, pass plan= and world_size= too")
    sharded = shard_plan(model, resolve_plan(model, plan, world_size), world_size)
    return sharded.slice_map(model), world_size


def infer_sharded_device_map(model: nn.Module) -> dict[str, str]:
    """``{name: device}`` for every shard module, parameter and buffer of a TensorParallel model
    (``module_shards.1.layers.0.attn.wq.weight`` -> ``"cuda:1"``). Devices are strings, which accelerate's
    ``set_module_tensor_to_device`` takes (some of its versions refuse ``torch.device`` values)."""
    if not is_split_model(model):
        raise TypeError(f"infer_sharded_device_map needs a TensorParallel model; got {type(model).__name__}")
    devices = [str(d) for d in getattr(model, "_placement", model.devices)]
    out: dict[str, str] = {}
    for rank, shard in enumerate(model.module_shards):
        prefix = f"module_shards.{rank}"
        for name, _ in shard.named_modules(remove_duplicate=False):
            out[f"{prefix}.{name}" if name else prefix] = devices[rank]
        tensors = list(shard.named_parameters(remove_duplicate=False)) + list(shard.named_buffers(remove_duplicate=False))
        for name, _ in tensors:
            out[f"{prefix}.{name}"] = devices[rank]
    return out
