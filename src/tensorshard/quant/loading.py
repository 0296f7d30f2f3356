"""Quantizing while loading: `tp.from_pretrained(path, devices, quantization_config=BitsAndBytesConfig(...))`.

1. `prepare_empty`: the model, built on the meta device, gets bitsandbytes layers in place of its Linear
   layers, as transformers' own from_pretrained does (the same `replace_with_bnb_linear`, the same layers
   kept in full precision: lm_head, tied weights, `llm_int8_skip_modules`). Their weights are still empty
   full-precision tensors, so the plan splits them by their (out, in) shape and refuses splits through a
   quantization block, as for a quantized model.
2. The streaming loader reads each device's slice of a weight in full precision, and `quantize_slice`
   quantizes it on its device right away, before the next tensor is read: a device never holds more than
   its quantized share plus one tensor's slice in full precision.

A slice quantized on its own equals the slice of the whole weight quantized (4-bit: the same blocks,
since splits keep blocks whole; 8-bit: a column-parallel slice has the same row scales), except for a
row-parallel 8-bit layer, whose row scales come from the device's own columns, and for double
quantization, whose second-level blocks are formed from the device's own absmax values.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from .detect import bitsandbytes_module, require_bitsandbytes, weight_kind


def check_config(config: Any) -> None:
    """Accept a transformers BitsAndBytesConfig for 4-bit or 8-bit; refuse anything else by name."""
    require_bitsandbytes("from_pretrained(..., quantization_config=...)")
    if type(config).__name__ != "BitsAndBytesConfig" or not type(config).__module__.startswith("transformers."):
        raise TypeError(
            f"quantization_config must be a transformers BitsAndBytesConfig (load_in_4bit=True or load_in_8bit=True); "
            f"got {type(config).__name__}"
        )
    if not (config.load_in_4bit or config.load_in_8bit):
        raise ValueError("quantization_config quantizes nothing: pass BitsAndBytesConfig(load_in_4bit=True) or load_in_8bit=True")


def prepare_empty(model: nn.Module, config: Any) -> nn.Module:
    """Swap the empty model's Linear layers for bitsandbytes ones (still empty, not yet quantized)."""
    check_config(config)
    transformers = sys.modules["transformers"]  # loaded: `config` is one of its classes (check_config)
    skip = list(config.llm_int8_skip_modules or [])
    if isinstance(model, transformers.PreTrainedModel):  # what transformers keeps whole: lm_head, tied, fp32 modules
        skip = transformers.quantizers.HfQuantizer.get_modules_to_not_convert(
            model, config.llm_int8_skip_modules, model._keep_in_fp32_modules
        )
    transformers.integrations.replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=config)
    if hasattr(model, "config"):
        model.config.quantization_config = config
        setattr(model, "is_loaded_in_4bit" if config.load_in_4bit else "is_loaded_in_8bit", True)
    return model


def quantize_slice(template: torch.Tensor, data: torch.Tensor) -> torch.Tensor | None:
    """`data`, one device's full-precision slice of the weight `template` stands for, quantized on its
    device with `template`'s settings; None when `template` is not a weight waiting to be quantized."""
    bnb = bitsandbytes_module()
    kind = weight_kind(template)
    if kind == "4bit" and not template.bnb_quantized:
        weight = bnb.nn.Params4bit(
            data, requires_grad=False, blocksize=template.blocksize, compress_statistics=template.compress_statistics,
            quant_type=template.quant_type, quant_storage=template.quant_storage,
        )
        return weight._quantize(data.device)
    if kind == "8bit" and template.dtype != torch.int8 and not template.has_fp16_weights:
        weight = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False)
        return weight._quantize(data.device)
    return None


def quantizing_converter(layout):
    """For the streaming loader: quantize each new slice whose template in `layout` is a bitsandbytes weight."""

    def convert(entry, rank: int, storage: torch.Tensor) -> torch.Tensor:
        quantized = quantize_slice(layout.local(entry, rank), storage)
        return storage if quantized is None else quantized

    return convert
