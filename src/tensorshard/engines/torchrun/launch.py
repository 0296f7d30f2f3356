"""`tensor_parallel(module, distributed=True)`: the job torchrun started becomes one tensor-parallel group.

    # torchrun --nproc_per_node=2 train.py
    model = tp.tensor_parallel(model, distributed=True)    # every process of the job: one rank of the mesh

Each process picks the one device it drives (`device_ids`' only entry, else what an existing process group
runs on, else cuda:LOCAL_RANK or the CPU), initialises the default process group from torchrun's environment
when it is not up yet (NCCL on GPUs, gloo on CPU), builds a 1-D mesh over every process and hands the module
to `parallelize` (engine.py). A node with more processes than GPUs is refused on every rank alike, before any
group is made.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ...comm.timeout import resolve_timeout
from ...devices import as_device, device_list
from ...plans.plan import Plan
from .engine import parallelize


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def tensor_parallel_distributed(
    module: nn.Module,
    device_ids: Sequence | None = None,
    *,
    plan: Plan | dict | None = None,
    sharded: bool | None = None,
    timeout: float | None = None,
    balance: bool = False,
) -> nn.Module:
    """`tensor_parallel(module, distributed=True)`: every process of the job is one tensor-parallel rank.

    Initialises the default process group from torchrun's environment when it is not yet (NCCL on GPUs,
    gloo on CPU), builds a 1-D mesh over all processes, and calls `parallelize`. Returns the module.
    This process's device: `device_ids`' only entry; else, in a process group that is already up, what its
    backend runs on (a gloo group: the CPU, even where GPUs are visible; an NCCL group: cuda:LOCAL_RANK);
    else cuda:LOCAL_RANK when every process on this node has a GPU of its own, the CPU without GPUs.
    """
    if sharded:
        raise NotImplementedError(
            "sharded=True with distributed=True: shard the replicated parameters with torch's fully_shard on a "
            "data-parallel mesh instead (2-D parallelism, see docs/torchrun.md)"
        )
    timeout = resolve_timeout(timeout)
    device = _given_device(device_ids)
    started = dist.is_initialized()
    if not started and not _under_torchrun():
        raise RuntimeError(
            "tensor_parallel(..., distributed=True) runs one process per device: launch the script with "
            "`torchrun --nproc_per_node=N script.py` (or call torch.distributed.init_process_group() first). "
            "No process group is initialised and RANK/WORLD_SIZE/MASTER_ADDR are not set. For one process "
            "and several devices, drop distributed=True."
        )
    if device is None:
        device = _default_device(dist.get_backend_config() if started else None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not started:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout))

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tensor_parallel",))
    return parallelize(module, mesh, plan, timeout=timeout, balance=balance)


def _given_device(device_ids: Sequence | None) -> torch.device | None:
    """The one device this process drives as `device_ids` names it, checked; None when not given."""
    if device_ids is None:
        return None
    if isinstance(device_ids, (str, int, torch.device)):
        device_ids = [device_ids]
    devices = device_list(device_ids)  # a dict or a set is refused, as without distributed=True
    if len(devices) != 1:
        raise ValueError(
            f"with distributed=True each process drives one device; device_ids={device_ids!r} lists "
            f"{len(devices)}. Pass None (cuda:LOCAL_RANK, else cpu) or this process's device, e.g. ['cuda:1']."
        )
    return as_device(devices[0], what="device_ids[0]")


def _default_device(backends: str | None) -> torch.device:
    """The device of a process that named none. `backends`: the process group's backend per device type
    ("cpu:gloo,cuda:nccl"), or None when no group is up yet (then one is made for the device chosen here).

    A group that is up decides: CUDA tensors only where it runs NCCL (a gloo group, such as a CPU job's on a
    machine that also has GPUs, keeps to the CPU). Otherwise every process of this node must get a GPU of its
    own, or none does: a node with more processes than GPUs is refused on every rank alike, before any
    group is made (some ranks on NCCL and the others refused would leave the first waiting for the rest)."""
    if backends is not None and "nccl" not in backends:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    rank = os.environ.get("RANK", "?")
    local_rank = _env_int("LOCAL_RANK", "0", "this process's index on its node")
    if backends is None and "LOCAL_WORLD_SIZE" in os.environ:
        local_world = _env_int("LOCAL_WORLD_SIZE", "1", "the number of processes on this node")
        if local_world > count:
            raise ValueError(
                f"rank {rank} (LOCAL_RANK={local_rank}): this node runs {local_world} processes (LOCAL_WORLD_SIZE) "
                f"but {count} cuda device(s) are visible, and NCCL needs a GPU per process. Start at most "
                f"{count} process(es) per node (torchrun --nproc_per_node={count}), make more GPUs visible "
                f"(CUDA_VISIBLE_DEVICES), or pass device_ids=['cpu'] to run every rank on the CPU with gloo."
            )
    if not 0 <= local_rank < count:
        raise ValueError(
            f"rank {rank} (LOCAL_RANK={local_rank}) has no GPU: {count} cuda device(s) are visible "
            f"(cuda:0..cuda:{count - 1}). Start at most {count} process(es) per node (torchrun "
            f"--nproc_per_node={count}), or make more GPUs visible (CUDA_VISIBLE_DEVICES)."
        )
    return torch.device("cuda", local_rank)


def _env_int(name: str, default: str, meaning: str) -> int:
    raw = os.environ.get(name, default)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; torchrun sets it to {meaning}") from None
