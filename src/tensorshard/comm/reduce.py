"""The reductions of the in-process engine's collectives, and what shards must agree on to run one.

CUDA tensors on distinct GPUs go through NCCL (`torch.cuda.nccl`) when it is available and
TENSOR_PARALLEL_USE_NATIVE is not set, else through peer copies to the first device; CPU tensors are
summed in memory. Sums run in rank order, so every shard gets a bit-identical result and replicated
activations never drift apart; every device receives its own copy of a result, so a shard may modify it
in place.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.cuda.nccl as nccl


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _distinct_gpus(tensors: Sequence[torch.Tensor]) -> bool:
    devs = [t.device for t in tensors]
    return all(d.type == "cuda" for d in devs) and len(set(devs)) == len(devs)


def native_collectives() -> bool:
    """TENSOR_PARALLEL_USE_NATIVE=1 (the tensor_parallel package's switch): plain PyTorch copies and sums
    instead of NCCL, to tell an NCCL problem from a model problem. "0", "false" or unset: off."""
    return os.environ.get("TENSOR_PARALLEL_USE_NATIVE", "").strip().lower() in ("1", "true", "yes", "on")


def sum_to_all(tensors: Sequence[torch.Tensor], devices: Sequence[torch.device]) -> list[torch.Tensor]:
    """Sum over devices; every device gets its own copy of the (bit-identical) result."""
    if _distinct_gpus(tensors) and not native_collectives():
        try:
            if nccl.is_available(list(tensors)):
                outs = [torch.empty_like(t) for t in tensors]
                nccl.all_reduce([t.contiguous() for t in tensors], outputs=outs)
                return outs
        except (ImportError, RuntimeError):
            pass
    total = sum_on(tensors, devices[0])
    return [total] + [total.to(d, copy=True) for d in devices[1:]]


def sum_on(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The rank-ordered sum on `device`, a new tensor: bit-identical wherever it is computed (on one device
    type), so on CPU every shard may compute its own (comm/per_shard.py)."""
    total = tensors[0].to(device) + tensors[1].to(device)
    for t in tensors[2:]:
        total += t.to(device)
    return total


EACH_MIN_BYTES = 256 * 1024  # smaller results: one shard computes them all (see each_computes_its_own)


def each_computes_its_own(devices: Sequence[torch.device], nbytes: int) -> bool:
    """CPU slots and a result of `nbytes` >= EACH_MIN_BYTES: each shard sums (or concatenates) for itself, in its
    thread, at the same time as the others, rather than one shard computing every result and copying it to the
    others while they wait (a 2 MiB activation, the 32 MiB of gathered logits). A small result (a decode step's
    4 KiB) costs less to compute for all than the second meeting that per-shard results need (every shard must
    have read the others' tensors before any returns). GPUs keep one NCCL call (or peer copies) for all.
    `nbytes` is the same on every shard, so all take the same path."""
    return nbytes >= EACH_MIN_BYTES and all(d.type == "cpu" for d in devices)


def copies(t: torch.Tensor, devices: Sequence[torch.device]) -> list[torch.Tensor]:
    """The first device keeps `t`; the others get their own copies."""
    return [t] + [t.to(d, copy=True) for d in devices[1:]]


def signature(x: torch.Tensor, skip_dim: int | None = None) -> tuple:
    """What must agree between ranks at a collective: the shape (but `skip_dim`) and the dtype."""
    shape = tuple("*" if d == skip_dim else n for d, n in enumerate(x.shape))
    return shape, str(x.dtype).removeprefix("torch.")
