"""Recognising quantized models without importing bitsandbytes, and requiring it when one is found.

A bitsandbytes layer is told by its weight's class (`Params4bit`, `Int8Params`) or, for a transformers
model, by `config.quantization_config`. tensorshard never imports bitsandbytes itself, so a plain model costs
nothing and a quantized one without the package is refused with the extra to install.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import torch
from torch import nn

EXTRA = "pip install 'tensorshard[quant]'"  # bitsandbytes, version range in pyproject.toml

_WEIGHT_CLASSES = {"Params4bit": "4bit", "Int8Params": "8bit"}


def weight_kind(tensor: Any) -> str | None:
    """'4bit' for a bitsandbytes Params4bit, '8bit' for an Int8Params, else None (by class name)."""
    if type(tensor) is nn.Parameter or type(tensor) is torch.Tensor:  # the common case, and one torch.compile traces
        return None
    for cls in type(tensor).__mro__:
        if cls.__name__ in _WEIGHT_CLASSES and cls.__module__.startswith("bitsandbytes"):
            return _WEIGHT_CLASSES[cls.__name__]
    return None


def quantization_method(model: nn.Module) -> str | None:
    """The quantization a model uses: 'bitsandbytes', another method's name (from its config), or None."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is not None:
        method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
        method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
        if method and str(method) != "gguf":  # transformers dequantizes GGUF weights when it loads them
            return str(method)
    if any(weight_kind(p) for p in model.parameters()):
        return "bitsandbytes"
    return None


def require_bitsandbytes(what: str) -> None:
    """Raise an ImportError naming `what` and the extra to install when bitsandbytes cannot be imported.

    tensorshard never imports bitsandbytes itself (seconds of import for every user): whoever made a
    quantized weight has, and so has transformers' bitsandbytes integration, which quantized loading uses.
    """
    if "bitsandbytes" in sys.modules:
        available = sys.modules["bitsandbytes"] is not None  # None: its import was blocked
    else:
        available = importlib.util.find_spec("bitsandbytes") is not None
    if not available:
        raise ImportError(f"{what} needs bitsandbytes, which is not installed: {EXTRA} (or pip install bitsandbytes)")


def check_quantized_model(model: nn.Module, engine: str) -> str | None:
    """Refuse, before anything changes, a quantized model this engine cannot split; return its method.

    bitsandbytes models need bitsandbytes installed; other methods (GPTQ, AWQ, ...) are not supported.
    The in-process engine also turns bitsandbytes' CPU bf16 kernel off in the model it is about to consume.
    """
    method = quantization_method(model)
    if method is None:
        return None
    if method != "bitsandbytes":
        raise NotImplementedError(
            f"{type(model).__name__} is quantized with {method!r}; tensorshard splits bitsandbytes 4-bit and "
            "8-bit models only (docs/quantization.md). Load it in full precision, or with "
            "BitsAndBytesConfig(load_in_4bit=True) / load_in_8bit=True."
        )
    require_bitsandbytes(f"splitting the bitsandbytes-quantized {type(model).__name__}")
    if engine == "inprocess":
        # Plan inference runs the model once; in eval mode on an AVX512-BF16 CPU that would repack its 4-bit
        # weights for bitsandbytes' bf16 kernel, rounding absmax to bf16 for good (quant/four_bit.py).
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    if engine != "inprocess":
        raise NotImplementedError(
            f"{type(model).__name__} is quantized with bitsandbytes; the torchrun engine (DTensor) cannot hold "
            "quantized weights. Split it in one process: tp.tensor_parallel(model, devices) "
            "(docs/quantization.md)."
        )
    return method


def bitsandbytes_module() -> Any:
    """The bitsandbytes module, for code that holds a bitsandbytes weight or layer (so it is imported)."""
    return sys.modules["bitsandbytes"]
