"""Checkpoints under torchrun: the layout of a model split by `parallelize`, and how its processes agree.

A process of a torchrun job holds one tensor-parallel rank of the model: DTensors whose local tensors
are this rank's slices, stored in the engine's "chunk" layout or its zero-padded "stacked" layout
(comm/dtensor.py). `TorchrunLayout` gives the checkpoint code the same view as one process holding
every rank: placements come from the engine's own `Partition`s and `local(entry, rank)` is the true
slice, a view of the DTensor's local tensor without the padding, so files hold the pieces of the real
tensors (never the padding) and a load writes straight into the DTensors.

Saving and loading are collective: every process of the job calls them, in the same order. A step that
can fail on some ranks only (a check, writing a file, reading one) ends in `Job.agree`: an all-gather of
every process's outcome, so an error on one rank is raised on every rank (the others re-raise it with a
note naming the rank) instead of leaving them waiting in the next collective.

Writers: the tensor-parallel group holding global rank 0 writes (its rank r writes rank r's files);
other groups (data-parallel replicas with the same weights) only take part in the agreements. Global
rank 0 is the coordinator: it picks the generation, writes the index and removes stale files.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..comm.process_group import gather_partition
from ..comm.dtensor import mesh_device
from ..plans.slices import split_layout
from .layout import ModelLayout, TensorEntry, _find, _owner, _state_dict_names, collect_entries


def is_parallelized(model: object) -> bool:
    """True for a module split in place by `tensorshard.parallelize` (the torchrun engine)."""
    split = split_layout(model)
    return split is not None and split.engine == "torchrun"


def _is_dtensor(t: object) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


@dataclass
class TorchrunLayout(ModelLayout):
    """The layout of a `parallelize`d module as seen from one process: it holds rank `rank` only."""
    module: nn.Module = None
    state: Any = None  # the engine's TorchrunState (plan, mesh, comm, splits, layouts)
    rank: int = 0

    @property
    def ranks(self) -> list[int]:
        return [self.rank]

    @property
    def root(self) -> nn.Module:
        return self.module

    def _stored(self, entry: TensorEntry):
        return self.state.layouts[entry.name]

    def _true(self, entry: TensorEntry, t: torch.Tensor) -> torch.Tensor:
        """The real slice inside a local tensor (DTensor or plain), without the stacked layout's padding."""
        if _is_dtensor(t):
            t = t.to_local()
        t = t.detach()
        stored = self._stored(entry)
        return stored.view(t) if stored.dim is not None else t

    def local(self, entry: TensorEntry, rank: int) -> torch.Tensor:
        self._check_rank(rank)
        return self._true(entry, _find(self.module, entry.name))

    def param(self, entry: TensorEntry, rank: int) -> torch.Tensor:
        self._check_rank(rank)
        return _find(self.module, entry.name)

    def state_local(self, entry: TensorEntry, rank: int, value: torch.Tensor) -> torch.Tensor:
        # AdamW keeps its moments as DTensors shaped like the parameter (padding included)
        return self._true(entry, value) if _is_dtensor(value) else value

    def new_local(self, entry: TensorEntry, rank: int, dtype: torch.dtype | None = None):
        stored = self._stored(entry)
        shape = list(entry.shape)
        if stored.dim is None:
            holder = torch.empty(shape, dtype=dtype or entry.dtype, device=mesh_device(self.state.mesh))
            return holder, holder
        shape[stored.dim] = stored.stored
        # zeros: the padding of the stacked layout must stay zero (comm/dtensor.py)
        make = torch.zeros if stored.padded else torch.empty
        holder = make(shape, dtype=dtype or entry.dtype, device=mesh_device(self.state.mesh))
        return holder, stored.view(holder)

    def as_state(self, entry: TensorEntry, rank: int, holder: torch.Tensor) -> torch.Tensor:
        param = _find(self.module, entry.name)
        if not _is_dtensor(param):
            return holder
        return self._stored(entry).to_dtensor(holder, self.state.mesh)

    def install(self, entry: TensorEntry, rank: int, holder: torch.Tensor) -> torch.Tensor:
        old = _find(self.module, entry.name)
        tensor = self._stored(entry).to_dtensor(holder, self.state.mesh) if _is_dtensor(old) else holder
        if entry.kind == "param":
            tensor = nn.Parameter(tensor, requires_grad=old.requires_grad)
        for name in entry.names:
            owner, attr = _owner(self.module, name)
            (owner._parameters if entry.kind == "param" else owner._buffers)[attr] = tensor
        return tensor

    def gather(self, entry: TensorEntry, device: torch.device | str = "cpu") -> torch.Tensor:
        """The whole tensor on every rank of the tensor-parallel group (an all-gather for split ones)."""
        local = self.local(entry, self.rank)
        if entry.placement is None:
            return local.to(device, copy=True)
        dim, partition = entry.placement
        return gather_partition(local, dim, partition, self.state.comm.group).to(device)

    def _check_rank(self, rank: int) -> None:
        if rank != self.rank:
            raise RuntimeError(f"this process holds tensor-parallel rank {self.rank}, not rank {rank}")


def torchrun_layout(module: nn.Module) -> TorchrunLayout:
    """The layout of a module split by `parallelize`, for this process's rank."""

    state = split_layout(module).state  # the torchrun engine's TorchrunState
    for name, p in module.named_parameters():
        if _is_dtensor(p) and p.device_mesh != state.mesh:
            raise NotImplementedError(
                f"{name} is a DTensor on mesh {p.device_mesh} (dims {p.device_mesh.mesh_dim_names}), not only on the "
                "tensor-parallel mesh: the model is also sharded by fully_shard (FSDP2). tensorshard's checkpoint "
                "functions read the tensor-parallel layout only; save this model with torch.distributed.checkpoint "
                "(dcp.save(get_model_state_dict(model)), or Lightning's save_checkpoint) and load it back on the same "
                "mesh, or save_sharded before applying fully_shard. See docs/checkpoints.md."
            )
    world, rank = state.comm.world_size, state.comm.rank
    entries = collect_entries(
        module,
        lambda name, tensor: state.splits.get(name),
        lambda tensor: tensor.to_local() if _is_dtensor(tensor) else tensor,
    )
    writes = 0 in dist.get_process_group_ranks(state.comm.group)
    device = mesh_device(state.mesh)
    return TorchrunLayout(
        world, [module], entries, state.plan, [], [device] * world,
        _state_dict_names(module), "torchrun", writes,
        module=module, state=state, rank=rank,
    )


# --- agreeing across processes --------------------------------------------------------------------------


class Job:
    """The processes that save or load together: one (in-process and plain models) or the torchrun job."""
    distributed = False
    coordinator = True  # writes the index, picks the generation
    rank = 0

    def agree(self, what: str, fn: Callable[[], Any]) -> list[Any]:
        """Run `fn` here; return every process's result (one here). Errors propagate."""
        return [fn()]


class TorchrunJob(Job):
    """Every process of the default process group."""
    distributed = True

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.coordinator = self.rank == 0

    def agree(self, what: str, fn: Callable[[], Any]) -> list[Any]:
        """Run `fn` on every process; if it raised anywhere, raise on every process. Returns the results
        of every process (by global rank)."""

        try:
            result, error = fn(), None
        except Exception as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
            result, error = None, e
        outcomes: list = [None] * self.world
        dist.all_gather_object(outcomes, (result, _portable(error)))
        if error is not None:
            raise error
        failed = [(r, e) for r, (_, e) in enumerate(outcomes) if e is not None]
        if failed:
            rank, first = failed[0]
            others = f" (and on rank(s) {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
            first.add_note(f"raised on rank {rank}{others} while {what}; rank {self.rank} stops with it")
            raise first
        return [r for r, _ in outcomes]


def _portable(error: Exception | None) -> Exception | None:
    """`error`, or a RuntimeError with its text when it cannot be sent to the other ranks."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")


def job_of(layout: ModelLayout) -> Job:
    return TorchrunJob() if isinstance(layout, TorchrunLayout) else Job()
