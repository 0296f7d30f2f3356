"""What tensor parallelism needs to know about each supported layer type.

For every layer kind: which weight dimension holds output and input features, which activation dimension
carries features (last for linear layers, 1 for convolutions), the attributes that record sizes, and how
to run the layer without its bias (a row-parallel layer adds its bias once, after the all-reduce).

Supported: nn.Linear (and subclasses, bitsandbytes' quantized Linear4bit / Linear8bitLt among them:
their shapes and products go through `tensorshard.quant`), transformers' GPT-2 style Conv1D (weight stored
(in, out)), nn.Conv1d/2d/3d with groups=1, nn.Embedding and nn.EmbeddingBag. Recognised without importing
their library: transformers models. Modules that wrap a layer of the model (an adapter library's) are known
through `register_layer_wrapper`, by the integration that knows the library (integrations/peft/ registers PEFT's).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from . import quant


@dataclass(frozen=True)
class LayerKind:
    name: str
    weight_out_dim: int  # weight dim of output features (channels)
    weight_in_dim: int  # weight dim of input features
    feature_dim: int  # activation dim carrying features
    in_attr: str | None  # attribute recording the input size
    out_attr: str | None  # attribute recording the output size
    matmul: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # (module, x, weight), no bias


def _conv_matmul(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return module._conv_forward(x, weight, None)


def _conv1d_hf_matmul(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # (..., in) @ (in, out_local) -> (..., out_local)
    return torch.matmul(x, weight)


def _linear_matmul(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if quant.weight_kind(weight):  # a packed 4-bit or int8 weight: the layer's own kernel
        return quant.matmul(module, x, weight)
    return F.linear(x, weight)


LINEAR = LayerKind("Linear", 0, 1, -1, "in_features", "out_features", _linear_matmul)
CONV1D_HF = LayerKind("Conv1D", 1, 0, -1, "nx", "nf", _conv1d_hf_matmul)
CONV = LayerKind("ConvNd", 0, 1, 1, "in_channels", "out_channels", _conv_matmul)
EMBEDDING = LayerKind("Embedding", 0, 1, -1, "num_embeddings", "embedding_dim", lambda m, x, w: x)


def is_hf_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D, recognised without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def layer_kind(module: nn.Module) -> LayerKind | None:
    """The kind of a supported layer, or None."""
    if isinstance(module, nn.Linear):
        return LINEAR
    if is_hf_conv1d(module):
        return CONV1D_HF
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return CONV
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return EMBEDDING
    return None


def weight_shape(module: nn.Module) -> torch.Size:
    """The shape of `module.weight` as the layer uses it: (out, in) for a packed 4-bit weight too."""
    return quant.logical_shape(module.weight)


def require_kind(module: nn.Module, style: str, where: str, allowed: tuple[LayerKind, ...]) -> LayerKind:
    """The layer kind of `module`, or a clear error when `style` cannot apply to it."""
    kind = layer_kind(module)
    if kind not in allowed:
        names = ", ".join(k.name for k in allowed)
        raise NotImplementedError(
            f"{style} cannot split {where} ({type(module).__name__}): it applies to {names}. "
            "Use Replicate() for this module, or ShardParams(...) to split its parameters yourself."
        )
    if kind is CONV and module.groups != 1:
        raise NotImplementedError(
            f"{style} cannot split {where}: grouped convolutions (groups={module.groups}) are not "
            "supported; replicate this layer"
        )
    if kind is CONV and module.padding_mode != "zeros" and style.startswith("Rowwise"):
        raise NotImplementedError(f"{style} cannot split {where}: padding_mode must be 'zeros'")
    return kind


def shape_along(kind: LayerKind, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`bias` shaped to broadcast over `x` along the feature dimension."""
    if kind.feature_dim == -1:
        return bias
    return bias.view(-1, *([1] * (x.dim() - 2)))


def is_transformers_model(module: object) -> bool:
    """True for a transformers PreTrainedModel, without importing transformers when nobody has."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


@dataclass(frozen=True)
class LayerWrapper:
    """A kind of module that wraps a layer of the model and calls it (an adapter library's), as registered by the
    integration that knows it."""

    is_one: Callable[[nn.Module], bool]
    inner: str  # the attribute holding the wrapped layer
    reads_inner: bool = False  # its own forward reads the wrapped layer's tensors (not only through its forward)
    # The plain state its forward depends on besides tensors (which adapter is active, merged, disabled, its scale),
    # as one hashable: a compiled step run without dynamo's guards compares it instead (engines/torchrun/unguarded.py)
    settings: Callable[[nn.Module], Hashable] | None = None


_LAYER_WRAPPERS: list[LayerWrapper] = []


def register_layer_wrapper(wrapper: LayerWrapper) -> LayerWrapper:
    """Make `wrapper` known to the code that looks through layer wrappers (the engines, compat/bare.py)."""
    if wrapper not in _LAYER_WRAPPERS:
        _LAYER_WRAPPERS.append(wrapper)
    return wrapper


def layer_wrapper(module: nn.Module) -> LayerWrapper | None:
    """The registered kind of layer wrapper `module` is, or None."""
    return next((w for w in _LAYER_WRAPPERS if w.is_one(module)), None)


def wrapped_layer(module: nn.Module) -> nn.Module | None:
    """The layer `module` wraps, if it is a registered layer wrapper; else None."""
    wrapper = layer_wrapper(module)
    return None if wrapper is None else getattr(module, wrapper.inner)

