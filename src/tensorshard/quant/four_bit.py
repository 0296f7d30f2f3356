"""Slicing a bitsandbytes 4-bit weight (`Params4bit`, NF4 or FP4) without dequantizing it.

bitsandbytes flattens the (out, in) weight row-major, cuts it into blocks of `blocksize` values (64 by
default) and stores, per block, one absmax and two 4-bit codes per byte:

    data    uint8 (out*in/2, 1)        value i in byte i // 2
    absmax  float32 (out*in / blocksize)   or, double-quantized ("nested"): uint8 codes of
                                           (absmax - offset) in blocks of 256, with their own absmax2

A device's slice is exact, byte for byte, when it holds whole blocks:
- by output rows [a, b): values [a*in, b*in), contiguous; needs a*in (and b*in) to be a multiple of blocksize;
- by input columns [a, b): in every row, values [row*in + a, row*in + b); needs in, a and b multiples of
  blocksize, so no block spans two rows.
A split that cuts a block is refused (`check_split`): requantizing the slice would give it different
blocks, hence different numbers. A nested absmax is kept nested when the slice starts on one of its
256-blocks (one contiguous row range); otherwise it is stored dequantized, as float32: the exact values
bitsandbytes computes with, at 4 bytes instead of ~1 per block.

On CPUs with AVX512-BF16, bitsandbytes repacks a weight for a bf16 kernel at its first eval-mode forward
(`packing_format_for_cpu`); `_standard_layout` undoes the repacking (its absmax is then the bf16-rounded one
that kernel used).
"""

from __future__ import annotations

import copy
import math
from typing import Sequence

import torch

from ..partition import Partition
from .detect import bitsandbytes_module

NESTED_BLOCK = 256  # bitsandbytes double-quantizes absmax in blocks of 256


def logical_shape(weight: torch.Tensor) -> torch.Size:
    """(out, in) of the weight a Params4bit stands for (its own shape is the packed one)."""
    if not weight.bnb_quantized:
        return weight.shape  # full-precision values waiting to be quantized (an empty skeleton)
    return torch.Size(weight.quant_state.shape)


def check_split(weight: torch.Tensor, dim: int, part: Partition, where: str) -> None:
    """Raise ValueError when `part` (along logical `dim`) would cut a quantization block."""
    out, inn = logical_shape(weight)
    bs = weight.blocksize if not weight.bnb_quantized else weight.quant_state.blocksize
    how = "output rows" if dim == 0 else "input features"
    fix = (
        "Use a device count whose slices hold whole blocks, quantize with a smaller blocksize, or keep this "
        "layer whole (Replicate() in the plan). docs/quantization.md explains the constraint."
    )
    if dim == 1 and inn % bs:
        raise ValueError(
            f"{where}: a 4-bit weight of {out}x{inn} quantized in blocks of {bs} values cannot be split by input "
            f"features at any device count: {inn} is not a multiple of {bs}, so blocks span two rows. Keep this "
            "layer whole (Replicate() in the plan), or quantize with a blocksize that divides the input "
            "features. docs/quantization.md explains the constraint."
        )
    unit = inn if dim == 0 else 1
    end = out if dim == 0 else inn
    for rank, ranges in enumerate(part.ranges):
        for start, stop in ranges:
            for edge in (start, stop):
                if edge != end and (edge * unit) % bs:
                    raise ValueError(
                        f"{where}: splitting this 4-bit weight ({out}x{inn}, quantized in blocks of {bs} values) by "
                        f"{how} over {part.world_size} devices cuts a quantization block: device {rank}'s slice "
                        f"{start}:{stop} has an edge at {edge} ({edge * unit} values, not a multiple of {bs}). {fix}"
                    )


def take(weight: torch.Tensor, split: tuple[int, Partition] | None, rank: int, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s slice of a Params4bit (None: the whole weight) as a new Params4bit on `device`."""
    if not weight.bnb_quantized:  # not quantized yet: an ordinary slice, quantized once loaded
        data = weight.data if split is None else split[1].take(weight.data, split[0], rank)
        return _like(weight, data if data.is_meta else data.to(device, copy=True), None)
    data, qs = _standard_layout(weight)
    out, inn = qs.shape
    if split is None:
        state = _copy_state(qs, device)
        return _like(weight, data.to(device, copy=True), state)
    dim, part = split
    ranges = part.ranges[rank]
    packed = data.view(torch.uint8).reshape(-1)
    bs = qs.blocksize
    if dim == 0:
        local_shape = (sum(b - a for a, b in ranges), inn)
        local = _cat([packed[a * inn // 2 : b * inn // 2] for a, b in ranges])
        blocks = [(a * inn // bs, math.ceil(b * inn / bs)) for a, b in ranges]
        if qs.nested and len(blocks) == 1 and blocks[0][0] % qs.state2.blocksize == 0:
            absmax, offset, state2 = _nested_slice(qs, *blocks[0])
        else:
            full = _absmax(qs)
            absmax, offset, state2 = _cat([full[s:e] for s, e in blocks]), None, None
    else:
        local_shape = (out, sum(b - a for a, b in ranges))
        rows = packed.view(out, inn // 2)
        local = _cat([rows[:, a // 2 : b // 2] for a, b in ranges], 1).reshape(-1)
        per_row = _absmax(qs).view(out, inn // bs)
        absmax, offset, state2 = _cat([per_row[:, a // bs : b // bs] for a, b in ranges], 1).reshape(-1), None, None
    state = bitsandbytes_module().functional.QuantState(
        absmax=absmax.to(device, copy=True),
        shape=torch.Size(local_shape),
        code=qs.code.to(device, copy=True),
        blocksize=bs,
        quant_type=qs.quant_type,
        dtype=qs.dtype,
        offset=None if offset is None else offset.to(device, copy=True),
        state2=state2 if state2 is None else _copy_state(state2, device),
    )
    local = local.reshape(-1, 1).to(device, copy=True)
    if weight.dtype != torch.uint8:  # quant_storage other than uint8 (bf16 for FSDP, say)
        local = local.view(weight.dtype)
    return _like(weight, local, state)


def state_bytes(weight: torch.Tensor) -> int:
    """Bytes of the quantization state (absmax, code, nested state) beside the packed data."""
    qs = getattr(weight, "quant_state", None)
    if qs is None:
        return 0
    total = 0
    for state in (qs, getattr(qs, "state2", None)):
        if state is None:
            continue
        for name in ("absmax", "code", "offset"):
            t = getattr(state, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


# --- helpers --------------------------------------------------------------------------------------------


def _like(weight: torch.Tensor, data: torch.Tensor, state) -> torch.Tensor:
    bnb = bitsandbytes_module()
    return bnb.nn.Params4bit(
        data,
        requires_grad=False,
        quant_state=state,
        blocksize=weight.blocksize,
        compress_statistics=state.nested if state is not None else weight.compress_statistics,
        quant_type=weight.quant_type,
        quant_storage=weight.quant_storage,
        bnb_quantized=state is not None,
    )


def _cat(pieces: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _absmax(qs) -> torch.Tensor:
    """The float32 absmax per block that bitsandbytes dequantizes with (undoing double quantization)."""
    if not qs.nested:
        return qs.absmax.float()
    bnb = bitsandbytes_module()
    return (bnb.functional.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset).float()


def _nested_slice(qs, start: int, stop: int):
    """Blocks [start, stop) of a nested absmax, still nested: `start` is on a 256-block boundary."""
    nbs = qs.state2.blocksize
    state2 = _copy_state(qs.state2, None)
    state2.absmax = qs.state2.absmax[start // nbs : math.ceil(stop / nbs)]
    return qs.absmax[start:stop], qs.offset, state2


def _copy_state(qs, device):
    """A QuantState whose tensors are copies on `device` (None: same device, still copies)."""
    out = copy.copy(qs)
    for name in ("absmax", "code", "offset"):
        t = getattr(qs, name, None)
        if isinstance(t, torch.Tensor):
            setattr(out, name, t.to(device, copy=True) if device is not None else t.clone())
    if getattr(qs, "state2", None) is not None:
        out.state2 = _copy_state(qs.state2, device)
    return out


def _standard_layout(weight: torch.Tensor):
    """(packed data, QuantState) in bitsandbytes' standard layout, undoing its CPU bf16 repacking."""
    qs = weight.quant_state
    if not getattr(qs, "packing_format_for_cpu", False):
        return weight.data, qs
    bnb = bitsandbytes_module()
    # The repacking turned absmax into bf16, shape (in/blocksize, out), and dropped double quantization.
    probe = _copy_state(qs, None)
    probe.original_nested = False  # keep bitsandbytes' inverse from requantizing absmax
    data, _ = bnb.functional._convert_weight_packed_for_cpu_inverse(weight.data, probe)
    state = bnb.functional.QuantState(
        absmax=qs.absmax.T.reshape(-1).float(),
        shape=qs.shape,
        code=qs.code,
        blocksize=qs.blocksize,
        quant_type=qs.quant_type,
        dtype=qs.original_dtype,
    )
    return data, state


def matmul(module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ W.T for a Linear4bit's (local) weight, without its bias, as `Linear4bit.forward` computes it."""
    bnb = bitsandbytes_module()
    if not module.compute_type_is_set:
        module.set_compute_type(x)
        module.compute_type_is_set = True
    dtype = x.dtype
    if module.compute_dtype is not None:
        x = x.to(module.compute_dtype)
    return bnb.matmul_4bit(x, weight, quant_state=weight.quant_state).to(dtype)
