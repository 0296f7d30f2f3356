"""What tensor parallelism needs to know about each supported layer type.

For every layer kind: which weight dimension holds output and input features, which activation dimension
carries features (last for linear layers, 1 for convolutions), the attributes that record sizes, and how
to run the layer without its bias (a row-parallel layer adds its bias once, after the all-reduce).

Supported: nn.Linear (and subclasses, bitsandbytes' quantized Linear4bit / Linear8bitLt among them:
their shapes and products go through `tensorshard.quant`), transformers' GPT-2 style Conv1D (weight stored
(in, out)), nn.Conv1d/2d/3d with groups=1, nn.Embedding and nn.EmbeddingBag. Recognised without importing
their library: transformers models, PEFT models and PEFT's layer wrappers (`is_adapter_layer`,
`is_modules_to_save`: integrations/peft/ splits them).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

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


def is_peft_model(module: object) -> bool:
    """True for a peft PeftModel, without importing peft when nobody has."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def is_adapter_layer(module: nn.Module) -> bool:
    """A PEFT tuner layer (LoRA, IA3, ...): it wraps the original layer as ``.base_layer`` (recognised by its
    attributes: PEFT is not imported; what follows from it is in integrations/peft/)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "active_adapters")


def is_modules_to_save(module: nn.Module) -> bool:
    """PEFT's ModulesToSaveWrapper (a trainable copy of a whole module per adapter)."""
    return isinstance(getattr(module, "original_module", None), nn.Module) and isinstance(
        getattr(module, "modules_to_save", None), nn.ModuleDict
    )

