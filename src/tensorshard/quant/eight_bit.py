"""Slicing a bitsandbytes 8-bit weight (`Int8Params` of a `Linear8bitLt`, LLM.int8()) without dequantizing.

bitsandbytes stores the (out, in) weight as int8 codes CB and one scale per output row, SCB (the row's
absmax): W ~= CB * SCB[:, None] / 127. Both splits are exact slices:
- by output rows: rows of CB and the same rows of SCB;
- by input features: columns of CB, and the whole SCB (a row keeps its scale).

What changes is the activation side: bitsandbytes quantizes the input per row (token) with that row's
absmax over the features it sees. A row-parallel device sees only its features, so its activation scale
differs from the unsplit layer's: the split result is still within LLM.int8()'s own error of the
full-precision layer, but not equal to the unsplit 8-bit one (docs/quantization.md has the numbers).

After its first forward, a Linear8bitLt keeps CB and SCB on `module.state` rather than on the weight;
`take` reads them from either place.
"""

from __future__ import annotations

import torch
from torch import nn

from ..partition import Partition
from .detect import bitsandbytes_module


def codes_and_scales(module: nn.Module | None, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(CB, SCB) of an Int8Params, wherever bitsandbytes keeps them (weight or module state)."""
    state = getattr(module, "state", None)
    scb = weight.SCB if getattr(weight, "SCB", None) is not None else getattr(state, "SCB", None)
    return weight.data, scb


def take(
    weight: torch.Tensor, module: nn.Module | None, split: tuple[int, Partition] | None, rank: int, device: torch.device
) -> torch.Tensor:
    """Rank `rank`'s slice of an Int8Params (None: the whole weight) as a new Int8Params on `device`."""
    bnb = bitsandbytes_module()
    codes, scales = codes_and_scales(module, weight)
    if split is not None:
        dim, part = split
        codes = part.take(codes, dim, rank)
        if dim == 0 and scales is not None:
            scales = part.take(scales, 0, rank)  # a row-parallel slice keeps every row's scale
    data = codes if codes.is_meta else codes.to(device, copy=True)
    local = bnb.nn.Int8Params(data, requires_grad=weight.requires_grad, has_fp16_weights=weight.has_fp16_weights)
    if data.dtype == torch.int8:
        local.CB = local.data
        local.SCB = None if scales is None else scales.to(device, copy=True)
    return local


def state_bytes(module: nn.Module | None, weight: torch.Tensor) -> int:
    """Bytes of the row scales beside the int8 codes (CB is the weight's own data)."""
    _, scales = codes_and_scales(module, weight)
    return 0 if scales is None else scales.numel() * scales.element_size()


def matmul(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ W.T for a Linear8bitLt's (local) weight, without its bias, as `Linear8bitLt.forward` computes it."""
    bnb = bitsandbytes_module()
    module.state.is_training = module.training
    if weight.CB is not None:
        module.init_8bit_state()
    out = bnb.matmul(x, weight, bias=None, state=module.state)
    if not module.state.has_fp16_weights and module.state.CB is not None:
        weight.data = module.state.CB
    return out
