"""Identical batches inside a tensor-parallel group, and the check that catches it when they are not.

Every rank of a tensor-parallel (TP) group computes a slice of the *same* forward pass, so every rank
must be fed the same batch. A data loader that shards by global rank, or random augmentation seeded per
process, gives each rank different data: the model then trains on a mix of batches without any error.

- `TensorParallelSampler(dataset, mesh)`: a DistributedSampler over the data-parallel replicas only;
  all ranks of one TP group draw the same indices.
- `broadcast_batch(batch, mesh)`: TP rank 0's batch, on every rank of its group (for pipelines that
  cannot be made deterministic).
- `check_same_inputs(...)`: compares a cheap fingerprint of every input tensor across the group and
  raises `InputMismatchError` naming the input. `tensorshard.parallelize` runs it on the first calls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten
from torch.utils.data import Dataset, DistributedSampler

from ...comm.objects import broadcast_object, gather_objects
from ...comm.dist_guard import collective
from ...comm.dtensor import mesh_device


class InputMismatchError(ValueError):
    """Ranks of one tensor-parallel group received different inputs."""


# --- the check ----------------------------------------------------------------------------------------


def _fingerprint(value: Any) -> Any:
    """Shape, dtype and two float64 checksums (the second weights positions, catching permutations)."""
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        flat = local.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device).remainder_(1009).add_(1)
        sums = (flat.sum().item(), (flat * weights).sum().item()) if flat.numel() else (0.0, 0.0)
        return ("tensor", tuple(value.shape), str(value.dtype), sums)
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    return ("object", type(value).__name__)  # compared by type only (a KV cache, a config)


def check_same_inputs(inputs: dict[str, Any], group=None, *, where: str = "the model") -> None:
    """Raise `InputMismatchError` on every rank when the ranks of `group` got different `inputs`.

    `inputs` maps argument names to values (nested lists/dicts/tuples are walked). Costs two small
    all-gathers (a pickled list of fingerprints: tensors are reduced to fingerprints first), bounded and
    failure-aware like every collective of the group (comm/dist_guard.py).
    """
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if world == 1:
        return
    leaves, _ = tree_flatten_with_path(inputs)
    prints = [(_name(path), _fingerprint(v)) for path, v in leaves]
    everyone = gather_objects(prints, group, what=f"the input check of {where}")
    ranks = dist.get_process_group_ranks(group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        if [n for n, _ in theirs] != [n for n, _ in reference]:
            raise InputMismatchError(
                f"{where} was called with different arguments on tensor-parallel ranks: "
                f"{[n for n, _ in reference]} on rank {ranks[0]} but {[n for n, _ in theirs]} on rank {ranks[rank]}. "
                + _HOW_TO_FIX
            )
        name, ours, other = next((n, a, b) for (n, a), (_, b) in zip(reference, theirs) if a != b)
        raise InputMismatchError(
            f"tensor-parallel ranks received different inputs: input {name!r} of {where} differs between "
            f"rank {ranks[0]} ({_describe(ours)}) and rank {ranks[rank]} ({_describe(other)}). " + _HOW_TO_FIX
        )


_HOW_TO_FIX = (
    "Every rank of a tensor-parallel group must get the same batch: sample with "
    "tensorshard.TensorParallelSampler(dataset, mesh) (Lightning's ModelParallelStrategy does this for its "
    "dataloaders), seed random augmentation identically on the group's ranks, or share TP rank 0's batch with "
    "tensorshard.broadcast_batch(batch, mesh). transformers.Trainer gives each rank its own batch: return a "
    "DataLoader with sampler=tensorshard.TensorParallelSampler(dataset, mesh) from its get_train_dataloader "
    "(docs/finetuning.md). parallelize(..., check_inputs=0) turns this check off."
)


def _name(path) -> str:
    text = keystr(path)  # "['input_ids']", "['batch'][0]"
    if text.startswith("['") and "']" in text:
        head, _, rest = text[2:].partition("']")
        return head + rest
    return text


def _describe(fingerprint) -> str:
    kind, *rest = fingerprint
    if kind == "tensor":
        shape, dtype, (total, weighted) = rest
        return f"shape {list(shape)}, {dtype.removeprefix('torch.')}, sum {total:.6g}, checksum {weighted:.6g}"
    if kind == "value":
        return repr(rest[0])
    return f"a {rest[0]}"


# --- giving every TP rank the same batch --------------------------------------------------------------


def _data_parallel_coordinates(mesh, tp_dim: str) -> tuple[int, int]:
    """(number of data-parallel replicas, this rank's replica) for a TP mesh or a (dp, tp) mesh."""
    if mesh.ndim > 1:
        names = mesh.mesh_dim_names or ()
        if tp_dim not in names:
            raise ValueError(f"mesh dims {names} have no {tp_dim!r}; name the tensor-parallel dim with tp_dim=")
        replicas, index = 1, 0
        for i, name in enumerate(names):
            if name != tp_dim:
                replicas, index = replicas * mesh.size(i), index * mesh.size(i) + mesh.get_local_rank(i)
        return replicas, index
    # A 1-D TP mesh: TP groups tile the world, as contiguous blocks (TP innermost) or strided.
    ranks = sorted(mesh.mesh.flatten().tolist())
    size = len(ranks)
    replicas = dist.get_world_size() // size
    contiguous = ranks[-1] - ranks[0] + 1 == size
    return replicas, (ranks[0] // size if contiguous else ranks[0])


class TensorParallelSampler(DistributedSampler):
    """A DistributedSampler over data-parallel replicas: every rank of a TP group draws the same indices.

    Args:
        dataset: the dataset.
        device_mesh: the 1-D tensor-parallel mesh, or a mesh with a dim named `tp_dim` (other dims are
            data-parallel), e.g. Lightning's ``device_mesh``.
        shuffle, seed, drop_last: as for DistributedSampler (call ``set_epoch`` every epoch).
    """

    def __init__(self, dataset: Dataset, device_mesh, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, tp_dim: str = "tensor_parallel") -> None:
        replicas, index = _data_parallel_coordinates(device_mesh, tp_dim)
        super().__init__(dataset, num_replicas=replicas, rank=index, shuffle=shuffle, seed=seed, drop_last=drop_last)


def broadcast_batch(batch: Any, device_mesh) -> Any:
    """TP rank 0's `batch` (any nest of tensors and plain values) on every rank of the 1-D `device_mesh`.

    Tensors keep their dtype and land on each rank's device (the device of its own batch tensors, else
    the mesh's device); shapes may differ between ranks' own batches.
    """
    group = device_mesh.get_group()
    if dist.get_world_size(group) == 1:
        return batch
    src = dist.get_global_rank(group, 0)
    leaves, spec = tree_flatten(batch)
    meta = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", x) for x in leaves]
    spec, meta = broadcast_object((spec, meta), src, group, what=f"broadcast_batch from rank {src}")

    device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), None) or mesh_device(device_mesh)
    out = []
    mine = dist.get_rank() == src
    for i, (first, second) in enumerate(meta):
        if first == "value":
            out.append(second)
            continue
        tensor = leaves[i].to(device).contiguous() if mine else torch.empty(first, dtype=second, device=device)
        collective(dist.broadcast, tensor, tensor, src=src, group=group, what=f"broadcast_batch from rank {src} (tensor #{i})")
        out.append(tensor)
    return tree_unflatten(out, spec)


# --- pickled objects over a group, through its guard (bounded, failure-aware: comm/dist_guard.py) ---------
