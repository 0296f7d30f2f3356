"""Quantized layers (bitsandbytes 4-bit and 8-bit) split without dequantizing.

The engine and the styles ask this package four things about a weight, whatever its quantization:
its logical (out, in) shape, whether a split cuts a quantization block (`check_split`, raised before the
model changes), each device's slice with its slice of the quantization state (`take`), and the bytes that
state adds (`module_bytes`, `stored_bytes`). A row-parallel layer multiplies through `matmul` (the layer's
own kernel, without its bias). Loading quantized is in loading.py, recognising quantized models (without
importing bitsandbytes) in detect.py.

See four_bit.py and eight_bit.py for the layouts, docs/quantization.md for what is exact.
"""

from __future__ import annotations

import torch
from torch import nn

from ..partition import Partition
from . import eight_bit, four_bit
from .detect import EXTRA, check_quantized_model, quantization_method, require_bitsandbytes, weight_kind
from .loading import check_config, prepare_empty, quantize_slice, quantizing_converter

__all__ = [
    "EXTRA",
    "check_config",
    "check_quantized_model",
    "check_split",
    "finish_module",
    "finish_shards",
    "logical_shape",
    "matmul",
    "module_bytes",
    "prepare_empty",
    "quantization_method",
    "quantize_slice",
    "quantizing_converter",
    "checkpoint_error",
    "quantized_names",
    "require_bitsandbytes",
    "selfcheck_tolerance",
    "skeleton_memo",
    "stored_bytes",
    "take",
    "weight_kind",
]


def logical_shape(weight: torch.Tensor) -> torch.Size:
    """The (out, in) shape a weight stands for: its own shape unless it is packed 4-bit."""
    return four_bit.logical_shape(weight) if weight_kind(weight) == "4bit" else weight.shape


def stored_bytes(tensor: torch.Tensor, shape: tuple[int, ...] | None = None) -> int:
    """Bytes `tensor` holds, or a slice of it of logical `shape` would hold, quantization state included.

    A bitsandbytes weight not quantized yet (an empty model prepared by `prepare_empty`) counts what it will
    hold once quantized: 4-bit, half a byte per value plus an absmax per block (one byte, plus the second
    level's, when double-quantized); 8-bit, one byte per value plus a float32 scale per row.
    """
    shape = torch.Size(shape if shape is not None else logical_shape(tensor))
    n = shape.numel()
    kind = weight_kind(tensor)
    if kind == "4bit":
        quantized = tensor.bnb_quantized
        bs = tensor.quant_state.blocksize if quantized else tensor.blocksize
        nested = tensor.quant_state.nested if quantized else bool(tensor.compress_statistics)
        blocks = -(-n // bs)
        absmax = blocks + (-(-blocks // four_bit.NESTED_BLOCK)) * 4 + 256 * 4 + 4 if nested else blocks * 4
        return -(-n // 2) + absmax + 16 * 4  # packed codes, absmax, the 16-value code book
    if kind == "8bit":
        return n + shape[0] * 4
    return n * tensor.element_size()


INT8_TOLERANCE = 5e-2  # relative; LLM.int8()'s own error is ~1e-2, a wrong split is off by O(1)


def selfcheck_tolerance(module: nn.Module, default: float) -> float:
    """How close a split copy must come to the whole one in the plan self-check: 8-bit layers quantize
    their activations per device, so row-parallel splits differ at 8-bit precision (eight_bit.py)."""
    if any(weight_kind(p) == "8bit" for p in module.parameters()):
        return max(default, INT8_TOLERANCE)
    return default


def quantized_names(module: nn.Module) -> frozenset[str]:
    """Names of the parameters of `module` that hold quantized values (not a template waiting to be quantized)."""
    return frozenset(
        name for name, p in module.named_parameters(remove_duplicate=False)
        if (weight_kind(p) == "4bit" and p.bnb_quantized) or (weight_kind(p) == "8bit" and p.dtype == torch.int8)
    )


def checkpoint_error(name: str) -> NotImplementedError:
    """The error for a checkpoint that would read or write the quantized weight `name`."""
    return NotImplementedError(
        f"{name} is a bitsandbytes quantized weight: tensorshard's checkpoints (save_sharded, load_sharded, "
        "save_gathered, save_pretrained of a split model) do not handle quantized weights (their slices are "
        "packed, their quantization state is not in the state dict). Save the full-precision checkpoint and load "
        "it quantized with tp.from_pretrained(path, devices, quantization_config=...) (docs/quantization.md); an "
        "adapter alone (QLoRA) saves as usual."
    )


def check_split(module: nn.Module, name: str, dim: int, part: Partition, where: str) -> None:
    """Raise ValueError, naming the fix, when splitting `module.<name>` along `dim` cuts a quantization block."""
    weight = getattr(module, name, None)
    if weight_kind(weight) and not isinstance(module, nn.Linear):
        raise NotImplementedError(
            f"{where}: splitting a quantized {type(module).__name__} is not supported (bitsandbytes Linear4bit and "
            "Linear8bitLt are); keep it whole with Replicate() in the plan"
        )
    if weight_kind(weight) == "4bit":
        four_bit.check_split(weight, dim, part, where)
    # 8-bit: one scale per output row, so every row or column split is exact.


def take(
    tensor: torch.Tensor, module: nn.Module, split: tuple[int, Partition] | None, rank: int, device: torch.device
) -> torch.Tensor:
    """Rank `rank`'s local copy of a quantized weight (None split: the whole weight) on `device`."""
    kind = weight_kind(tensor)
    if kind == "4bit":
        return four_bit.take(tensor, split, rank, device)
    return eight_bit.take(tensor, module, split, rank, device)


def module_bytes(module: nn.Module) -> int:
    """Bytes of quantization state the module's own weights carry beside their data (absmax, scales)."""
    total = 0
    for t in module._parameters.values():
        kind = weight_kind(t)
        if kind == "4bit":
            total += four_bit.state_bytes(t)
        elif kind == "8bit":
            total += eight_bit.state_bytes(module, t)
    return total


def skeleton_memo(module: nn.Module) -> dict[int, None]:
    """`copy.deepcopy` memo entries that keep a module's own quantization state out of a shard's skeleton.

    A Linear4bit points at its weight's QuantState, a Linear8bitLt keeps CB/SCB on `module.state`: copied
    per device, each would hold the whole layer's state. `finish_module` sets them from the local weight.
    """
    memo: dict[int, None] = {}
    for mod in module.modules():
        if getattr(mod, "quant_state", None) is not None and weight_kind(getattr(mod, "weight", None)) == "4bit":
            memo[id(mod.quant_state)] = None
        state = getattr(mod, "state", None)
        if weight_kind(getattr(mod, "weight", None)) == "8bit" and state is not None:
            for name in ("CB", "SCB"):
                if getattr(state, name, None) is not None:
                    memo[id(getattr(state, name))] = None
    return memo


def finish_module(module: nn.Module) -> None:
    """Point a shard's quantized layer at its local weight's state, once the local weight is in place
    (quantizing it first if it holds full-precision values, as a layer bitsandbytes has not quantized yet does).

    A Linear4bit of a split model runs bitsandbytes' float kernel (dequantize, then matmul), as on GPUs,
    rather than the bf16 kernel it repacks weights for in eval mode on AVX512-BF16 CPUs: that kernel rounds
    partial sums to bf16, so split and unsplit results would differ at bf16 precision, and it needs
    output slices of 32 rows.
    """
    weight = getattr(module, "weight", None)
    kind = weight_kind(weight)
    if kind and not weight.is_meta:  # full-precision values not quantized yet (loaded in place): now
        quantized = quantize_slice(weight, weight.data)
        if quantized is not None:
            module.weight = weight = quantized
    if kind == "4bit":
        module.quant_state = weight.quant_state
        weight.module = module
        module.support_avx512bf16_for_cpu = False
    elif kind == "8bit" and hasattr(module, "state"):
        module.state.CB = None  # set again from the local weight at the next forward (init_8bit_state)
        module.state.SCB = None


def finish_shards(shards) -> None:
    """`finish_module` for every quantized layer of every shard."""
    for shard in shards:
        for module in shard.modules():
            if weight_kind(getattr(module, "weight", None)):
                finish_module(module)


def matmul(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ W.T through the quantized layer's own kernel, without its bias."""
    if weight_kind(weight) == "4bit":
        return four_bit.matmul(module, x, weight)
    return eight_bit.matmul(module, x, weight)
