"""Python objects between the ranks of a torch.distributed process group: setup and checks, not the hot path.

    gather_objects(obj, group, what=...)          every rank's `obj`, in group rank order
    broadcast_object(obj, src, group, what=...)   global rank `src`'s `obj` on every rank

Like torch's all_gather_object / broadcast_object_list, but each a pair of collectives through the group's guard
(comm/dist_guard.py): bounded, and a rank that dies or does not arrive is named in the error.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from .dist_guard import collective
from .transport import all_gather_single


def _object_device(group) -> torch.device:
    getter = getattr(dist.distributed_c10d, "_get_object_coll_device", None)  # cuda for NCCL groups
    return torch.device(getter(group) if getter is not None else "cpu")


def gather_objects(obj: Any, group, *, what: str) -> list[Any]:
    """Every rank's `obj`, in group rank order: all_gather_object as two guarded all-gathers."""
    device = _object_device(group)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    sizes = torch.empty(world, dtype=torch.int64, device=device)
    collective(all_gather_single, sizes, sizes, torch.tensor([data.numel()], device=device), group=group, what=what)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    out = torch.empty(world * longest, dtype=torch.uint8, device=device)
    collective(all_gather_single, out, out, padded, group=group, what=what)
    out = out.cpu()
    return [pickle.loads(out[r * longest : r * longest + int(n)].numpy().tobytes()) for r, n in enumerate(sizes.tolist())]


def broadcast_object(obj: Any, src: int, group, *, what: str) -> Any:
    """Global rank `src`'s `obj` on every rank of `group`: broadcast_object_list as two guarded broadcasts."""
    device = _object_device(group)
    mine = dist.get_rank() == src
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device) if mine else None
    size = torch.tensor([data.numel() if mine else 0], dtype=torch.int64, device=device)
    collective(dist.broadcast, size, size, src=src, group=group, what=what)
    if not mine:
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
    collective(dist.broadcast, data, data, src=src, group=group, what=what)
    return obj if mine else pickle.loads(data.cpu().numpy().tobytes())
