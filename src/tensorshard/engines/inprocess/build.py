"""Building the shards of an in-process split model (engine.py), all or nothing.

One copy of the module tree per device: deep copies that share no tensor storage, filled tensor by tensor
with that device's slice (as the plan says) or a whole copy, each original tensor released (left on the meta
device) as soon as every device has its piece, so the whole model never exists twice. The styles then adapt
their modules in every shard (local sizes, a forward with collectives). Should anything fail before the end
(out of memory on a device, a style's error, Ctrl-C), the original gets its tensors back (rollback.py).

`consume` then makes the emptied original refuse calls, naming the split model that holds its weights.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from ... import quant
from ...comm.threads import ThreadComm, ThreadGroup
from ...plans.sharding import ShardedModel, direct_tensors
from ..shared_config import keep_shared
from .rollback import Released, restore


def build_shards(module: nn.Module, sharded: ShardedModel, devices: list[torch.device], group: ThreadGroup) -> list[nn.Module]:
    """One copy of the module tree per device, holding local slices; the original's tensors are released."""
    world = len(devices)
    # 1. Skeletons: deep copies that share no tensor storage (each tensor maps to a meta placeholder).
    placeholders = quant.skeleton_memo(module)  # a quantized layer's own reference to its state
    placeholders.update(keep_shared(module))  # one configuration for every shard, not a copy each (shared_config.py)
    for t in list(module.parameters()) + list(module.buffers()):
        placeholders[id(t)] = torch.empty(0, device="meta")
    shards = [copy.deepcopy(module, memo=dict(placeholders)) for _ in range(world)]
    shard_modules = [dict(s.named_modules(remove_duplicate=False)) for s in shards]

    # 2. Fill them tensor by tensor, releasing each original tensor once every device has its slice.
    #    Should anything fail before the end (out of memory on a device, a style's error, Ctrl-C), the
    #    original gets its tensors back: the model is left as it was.
    made: dict[tuple[int, int], torch.Tensor] = {}
    reused: set[int] = set()
    released: list[Released] = []
    kept: list[torch.Tensor] = []
    where = "the shards' skeletons"
    try:
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            for kind, tname, t in list(direct_tensors(mod)):
                split = sharded.split_of(t)
                for rank in range(world):
                    where = f"{mod_name}.{tname}".lstrip(".") + f" on {devices[rank]} (rank {rank})"
                    key = (id(t), rank)
                    if key not in made:
                        made[key] = (
                            quant.take(t, mod, split, rank, devices[rank]) if quant.weight_kind(t)
                            else _local_tensor(t, split, rank, devices[rank], kind, reused)
                        )
                    target = shard_modules[rank][mod_name]
                    (target._parameters if kind == "param" else target._buffers)[tname] = made[key]
                released.append(Released(mod, kind, tname, weakref.ref(t), id(t), t.device, t.requires_grad, split))
                if quant.weight_kind(t):
                    kept.append(t)  # a quantized weight cannot be rebuilt from its slices: keep it until done
                _release(mod, kind, tname, t)
        quant.finish_shards(shards)  # quantized layers: their own state now follows the local weight

        # 3. Let each style adapt its module in every shard (sizes, forward with collectives). With one device
        #    every layer is whole and runs its own forward.
        if world > 1:
            for rank in range(world):
                comm = ThreadComm(group, rank)
                for name, ms in sharded.modules.items():
                    where = f"{name or '<root>'} ({type(ms.style).__name__}) on rank {rank}"
                    # each style's comm bound to its module's name: compiled, blocks and shards share graphs
                    ms.style.attach(shard_modules[rank][name], ms.splits, ms.context(rank, world, comm.at(name or "<root>")))
    except BaseException as e:
        restore(released, made, world)
        if hasattr(e, "add_note"):
            e.add_note(f"while building the shards, at {where}; the original model was restored as it was")
        raise
    return shards


def _local_tensor(t, split, rank, device, kind, reused: set[int]):
    data = t.detach()
    if split is not None:
        dim, part = split
        data = part.take(data, dim, rank)
        local = data if data.is_meta else data.to(device, copy=True)
    elif data.is_meta:
        local = data
    elif data.device == device and id(t) not in reused:
        reused.add(id(t))  # the first device that needs a whole tensor takes over its storage
        local = data
    else:
        local = data.to(device, copy=True)
    return nn.Parameter(local, requires_grad=t.requires_grad) if kind == "param" else local


def _release(mod: nn.Module, kind: str, name: str, t: torch.Tensor) -> None:
    meta = torch.empty_like(t, device="meta")
    if kind == "param":
        mod._parameters[name] = nn.Parameter(meta, requires_grad=t.requires_grad)
    else:
        mod._buffers[name] = meta


def consume(module: nn.Module, world: int) -> int:
    def refuse(*_):
        raise RuntimeError(
            f"this {type(module).__name__} was split over {world} device(s) by tensorshard.tensor_parallel(); its "
            "weights now live in the TensorParallel model it returned (the original is left on the meta device). "
            "Call that model, or deep-copy the original before splitting it if you need both."
        )

    return module.register_forward_pre_hook(refuse).id
