"""How a rank's slice of a split tensor is stored as a DTensor on the tensor-parallel mesh.

DTensor's `Shard(dim)` places slices like `torch.chunk`: ceil(n / N) per rank, the last ranks get what is
left. Our partitions are richer (larger runs first: 90 over 4 is 23/23/22/22; fused blocks such as q|k|v
or gate|up; KV heads replicated on several ranks), so the placement is chosen per tensor:

1. **chunk layout**: the partition gives each rank one contiguous run, in rank order, of exactly the
   length `torch.chunk` would (every even split; 176 over 3 = 59/59/58; 9 heads over 2 = 5/4). The
   parameter is a `Shard(dim)` DTensor of the real tensor: a distributed checkpoint holds the real
   weights, and PyTorch itself can reshard it.
2. **stacked layout**, everything else: the DTensor's global tensor is the rank-order concatenation of
   the local slices, each padded with zeros to the longest (90 over 4: 4 x 23 = 92 rows). Still a plain
   `Shard(dim)` DTensor with equal local shapes, so FSDP2 (`fully_shard`) and `torch.distributed.
   checkpoint` at the same rank count work unchanged; the forward pass reads the unpadded view, so the
   padding gets zero gradients and stays zero under every optimizer. The saved tensor is a storage
   layout, not the model's weight: reloading at another rank count (or unsplit) goes through the
   partition, not through DCP's own resharding.

Replicated tensors are `Replicate()` DTensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..partition import Partition


def chunk_sizes(n: int, world: int) -> list[int]:
    """Lengths `torch.chunk(n, world)` gives (DTensor's Shard): 10 over 4 -> [3, 3, 3, 1]."""
    c = math.ceil(n / world)
    return [max(0, min(c, n - r * c)) for r in range(world)]


def chunk_partition(n: int, world: int) -> Partition:
    """A Partition with torch.chunk's layout; refuses to leave a rank empty."""
    sizes = chunk_sizes(n, world)
    if 0 in sizes:
        raise ValueError(f"{n} entries split like torch.chunk over {world} devices leave a device empty; use fewer devices")
    starts = [sum(sizes[:r]) for r in range(world)]
    return Partition(n, tuple(((s, s + k),) for s, k in zip(starts, sizes)))


def is_chunk_layout(partition: Partition) -> bool:
    """True when `partition` places data exactly as DTensor's Shard does."""
    if partition.overlapping:
        return False
    c, n = math.ceil(partition.size / partition.world_size), partition.size
    return all(
        rngs == ((r * c, min(n, (r + 1) * c)),) for r, rngs in enumerate(partition.ranges)
    )


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


@dataclass(frozen=True)
class Layout:
    """Storage of one tensor of this rank: split along `dim` (None: replicated), `local` true entries
    stored in `stored` (>= local: zero padding at the end), the DTensor `global_size` long."""

    dim: int | None = None
    local: int = 0
    stored: int = 0
    global_size: int = 0

    @property
    def padded(self) -> bool:
        return self.stored > self.local

    @classmethod
    def of(cls, split: tuple[int, Partition] | None, rank: int) -> "Layout":
        if split is None:
            return cls()
        dim, part = split
        sizes = [part.local_size(r) for r in range(part.world_size)]
        if is_chunk_layout(part):
            return cls(dim, sizes[rank], sizes[rank], part.size)
        return cls(dim, sizes[rank], max(sizes), max(sizes) * part.world_size)

    def to_dtensor(self, local: torch.Tensor, mesh) -> "DTensor":
        """This rank's slice as a DTensor (padding it when the layout says so; a `local` that already has
        the stored length, padding included, is used as it is)."""

        if self.dim is None:
            return DTensor.from_local(local, mesh, (Replicate(),), run_check=False)
        if self.padded and local.shape[self.dim] == self.local:
            pad = list(local.shape)
            pad[self.dim] = self.stored - self.local
            local = torch.cat([local, local.new_zeros(pad)], self.dim)
        return _sharded(local, mesh, self.dim, self.global_size)

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The true slice inside a stored local tensor."""
        return local.narrow(self.dim, 0, self.local) if self.padded else local


def as_dtensor(x: torch.Tensor, dim: int, partition: Partition, mesh, *, where: str = "") -> "DTensor":
    """A split activation as the `Shard(dim)` DTensor it is (differentiable); the split must be chunk-like."""
    if not is_chunk_layout(partition):
        raise ValueError(
            f"{where}: an output split {[partition.local_size(r) for r in range(partition.world_size)]} is not "
            "torch.chunk's layout, so it cannot be handed out as a DTensor; split it with chunk_partition()"
        )
    return _sharded(x, mesh, dim, partition.size)


def _sharded(local: torch.Tensor, mesh, dim: int, global_size: int) -> "DTensor":
    """`local` as this rank's piece of a `Shard(dim)` DTensor `global_size` long along `dim`."""

    shape = list(local.shape)
    shape[dim] = global_size
    return DTensor.from_local(
        local, mesh, (Shard(dim),), run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape)
    )


def mesh_device(mesh) -> torch.device:
    """This process's device on `mesh` (the current CUDA device for a "cuda" mesh)."""
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())
