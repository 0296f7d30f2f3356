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
    if not tensors[0].is_cuda:  # CPU slots (decoding calls this per collective: the cheap answer first)
        return False
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
    type), and element by element to `sum_chunk_into`'s."""
    total = tensors[0].to(device) + tensors[1].to(device)
    for t in tensors[2:]:
        total += t.to(device)
    return total


def sum_chunk_into(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], rank: int) -> None:
    """Shard `rank`'s part of an all-reduce on CPU slots: chunk `rank` of the rank-ordered sum of `inputs`,
    written into every one of `outputs` (one per shard, contiguous, all in this process's memory).

    With every shard doing this for its own chunk at once, each reads one input's worth and writes one output's
    worth, whatever the device count: had each summed everything for itself, every shard would read all N
    inputs, N^2 tensors in all. An element's sum is computed exactly as `sum_on` computes it (in rank order), so
    the result is bit-identical to it."""
    flat_in = [t.view(-1) for t in inputs]
    start, stop = _chunk(flat_in[0].numel(), len(inputs), rank)
    if stop <= start:
        return
    total = flat_in[0][start:stop] + flat_in[1][start:stop]
    for t in flat_in[2:]:
        total += t[start:stop]
    for out in outputs:
        out.view(-1)[start:stop].copy_(total)


def _chunk(n: int, parts: int, rank: int, align: int = 16) -> tuple[int, int]:
    """Element range [start, stop) of chunk `rank` of `n` elements, in runs of `align` elements (64 bytes of
    float32: two shards never write to one cache line)."""
    blocks = -(-n // align)
    base, extra = divmod(blocks, parts)
    start = (rank * base + min(rank, extra)) * align
    stop = start + (base + (1 if rank < extra else 0)) * align
    return min(start, n), min(stop, n)


EACH_MIN_BYTES = 256 * 1024  # smaller results: one shard computes them all (see each_computes_its_own)


def each_computes_its_own(devices: Sequence[torch.device], nbytes: int) -> bool:
    """CPU slots and a result of `nbytes` >= EACH_MIN_BYTES: the shards compute the result together, each in its
    thread (a chunk of a sum, `sum_chunk_into`; its own concatenation), at the same time as the others, rather
    than one shard computing every result and copying it to the others while they wait (a 2 MiB activation, the 32 MiB of gathered logits). A small result (a decode step's
    4 KiB) costs less to compute for all than the second meeting that per-shard results need (every shard must
    have read the others' tensors before any returns). GPUs keep one NCCL call (or peer copies) for all.
    `nbytes` is the same on every shard, so all take the same path."""
    return nbytes >= EACH_MIN_BYTES and all(d.type == "cpu" for d in devices)


def copies(t: torch.Tensor, devices: Sequence[torch.device]) -> list[torch.Tensor]:
    """The first device keeps `t`; the others get their own copies."""
    return [t] + [t.to(d, copy=True) for d in devices[1:]]


def signature(x: torch.Tensor, skip_dim: int | None = None) -> tuple:
    """What must agree between ranks at a collective: the shape (but `skip_dim`) and the dtype."""
    shape = tuple(x.shape) if skip_dim is None else tuple("*" if d == skip_dim else n for d, n in enumerate(x.shape))
    return shape, _DTYPE_NAMES.get(x.dtype) or str(x.dtype).removeprefix("torch.")


_DTYPE_NAMES = {t: str(t).removeprefix("torch.") for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
