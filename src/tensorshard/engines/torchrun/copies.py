"""Copies of a parallelized module: ``copy.deepcopy(model)`` under torchrun builds a second split model.

A parallelized module cannot be copied object by object: its state holds the tensor-parallel process group
(which torch cannot copy), and its forwards are closures the styles and the engine installed over the
module's own layers, so a copy made that way would call the original's layers. `deep_copy` builds the copy
the way the original was built instead: `parallelize` keeps a skeleton of the module as it was before
splitting (`keep_skeleton`: the module tree with meta tensors), which is copied and split again on the same
mesh with the same plan (no broadcast: nothing to read yet), then every tensor of this rank is cloned in
(ties kept), and every submodule takes the train/eval mode and ``requires_grad`` of its counterpart.

The copy shares what is not per model: the mesh, its process group and the group's guard (timeout, shared
memory). It gets its own `DistComm` (its per-call caches and its list of partial-gradient parameters name
the copy's modules) and its own `TorchrunState`. No collective runs, but every rank of the group should copy,
as it runs every other step of the model. Memory: one more copy of this rank's slices.

Not carried: hooks registered after `parallelize`, and other non-tensor state changed since (switch gradient
checkpointing on again on the copy). Copies of a model wrapped by ``fully_shard`` (FSDP2) after
`parallelize`, or that adapters were added to since, are refused with the fix.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...comm.dist import DistComm
from ...logs import get_logger
from ...plans.sharding import direct_tensors

logger = get_logger(__name__)


def keep_skeleton(module: nn.Module) -> tuple[nn.Module | None, str]:
    """A copy of `module`'s tree whose parameters and buffers are meta tensors (no memory), for `deep_copy`;
    or None and why, when the module cannot be deep-copied (`parallelize` must not fail for that)."""
    memo: dict[int, object] = {}
    for mod in module.modules():
        for kind, _, t in direct_tensors(mod):
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if kind == "param" else meta
    try:
        return copy.deepcopy(module, memo), ""
    except Exception as e:  # noqa: BLE001 - any failure only means copies of the split model are refused
        return None, f"{type(e).__name__}: {e}"


def deep_copy(model: nn.Module, memo: dict, resplit) -> nn.Module:
    """A second split `model` on the same mesh with clones of this rank's tensors (see the module docstring).
    `resplit(module, plan, comm, check_inputs, source, balance=...)` is the engine's split step, applied to the skeleton's copy."""
    state = model.tensorshard
    what = f"copy.deepcopy of a parallelized {type(model).__name__}"
    if state.skeleton is None:
        raise TypeError(
            f"{what}: the model could not be deep-copied before splitting ({state.skeleton_error}), so neither "
            "can its split. Copy the model before tp.parallelize and parallelize the copy too, or save this one "
            "(torch.distributed.checkpoint, or tp.save_sharded) and load it into a new split."
        )
    _refuse_resharded(model, state, what)
    new = copy.deepcopy(state.skeleton)  # meta tensors: only the module tree is copied
    comm = DistComm(state.mesh, state.comm.guard.timeout)  # the same group and guard: no collective here
    new_state = resplit(new, state.plan, comm, state.checks_left, None, balance=state.balance)
    new_modules = dict(new.named_modules(remove_duplicate=False))
    added = sorted(n for n, _ in model.named_modules(remove_duplicate=False) if n not in new_modules)
    if added:
        raise NotImplementedError(
            f"{what} that gained modules after tp.parallelize ({', '.join(added[:3])}{', ...' if len(added) > 3 else ''}"
            ": adapters added after splitting?): add them before parallelize, or copy the model before splitting "
            "and parallelize both"
        )
    memo[id(model)] = new
    clones: dict[int, torch.Tensor] = {}
    for name, old in model.named_modules(remove_duplicate=False):
        target = new_modules[name]
        target.training = old.training
        for kind, tname, t in direct_tensors(old):
            key = f"{name}.{tname}" if name else tname
            placeholder = (target._parameters if kind == "param" else target._buffers).get(tname)
            if placeholder is None or _local_shape(placeholder) != _local_shape(t):
                raise TypeError(
                    f"{what}: {key} is stored as {_describe(t)} on this rank, but a split of the model as it was "
                    f"parallelized stores it as {_describe(placeholder)}: it was replaced or resized after "
                    "tp.parallelize. Copy the model before changing it, or save it and load it into a new split."
                )
            if id(t) not in clones:
                data = t.detach().clone()
                clones[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if kind == "param" else data
            (target._parameters if kind == "param" else target._buffers)[tname] = clones[id(t)]
    new_state.skeleton, new_state.skeleton_error = state.skeleton, ""  # the copy can be copied in turn
    if dist.get_rank() == 0:
        logger.info("copied the parallelized %s (same mesh %s, plan of %d entries)", type(model).__name__,
                    state.mesh.mesh.tolist(), len(state.plan))
    return new


def _refuse_resharded(model: nn.Module, state, what: str) -> None:
    """Tensors that another parallelism (FSDP2's fully_shard) re-sharded over another mesh: a split of the
    skeleton cannot hold them."""
    for name, t in model.named_parameters(remove_duplicate=False):
        if isinstance(t, DTensor) and t.device_mesh != state.mesh:
            raise TypeError(
                f"{what}: {name} lives on mesh {t.device_mesh} instead of the tensor-parallel mesh {state.mesh} "
                "(fully_shard applied after parallelize?). Deep-copy the model before fully_shard and shard the "
                "copy too, or save it with torch.distributed.checkpoint and load it into a new model."
            )


def _local_shape(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return tuple((t._local_tensor if isinstance(t, DTensor) else t).shape)


def _describe(t: torch.Tensor | None) -> str:
    return "nothing" if t is None else f"a local {list(_local_shape(t))} tensor"
