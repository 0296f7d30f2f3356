"""PEFT's modules recognised without importing peft, and made known to the layers below this package.

    is_peft_model(model)        # a PeftModel (peft is loaded already if the model is one)
    is_adapter_layer(module)    # a tuner layer (LoRA, IA3, DoRA...): wraps the original layer as ``.base_layer``
    is_modules_to_save(module)  # ModulesToSaveWrapper: a trainable copy of a whole module per adapter

Importing this file registers them where the code below asks without naming PEFT: the kind of a PeftModel
holding a transformers model (model_kind.py, `PEFT`), and the two layer wrappers (layers.py
`register_layer_wrapper`): a tuner layer reads its base layer's tensors in its own forward (DoRA its weight's
norms, IA3 its vectors), so under torchrun the engine shows it their local views (engines/torchrun/local_views.py).
"""

from __future__ import annotations

import sys

from torch import nn

from ...layers import LayerWrapper, register_layer_wrapper
from ...model_kind import register_holder_kind

PEFT = "peft"  # the kind of a PeftModel around a transformers model (model_kind.py)


def is_peft_model(module: object) -> bool:
    """True for a peft PeftModel, without importing peft when nobody has."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def is_peft_class(cls: type) -> bool:
    """True for a subclass of peft's PeftModel (a split PeftModel's class is one), without importing peft."""
    peft = sys.modules.get("peft")
    return peft is not None and issubclass(cls, peft.PeftModel)


def is_adapter_layer(module: nn.Module) -> bool:
    """A PEFT tuner layer (LoRA, IA3, ...): it wraps the original layer as ``.base_layer`` (recognised by its
    attributes)."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "active_adapters")


def is_modules_to_save(module: nn.Module) -> bool:
    """PEFT's ModulesToSaveWrapper (a trainable copy of a whole module per adapter)."""
    return isinstance(getattr(module, "original_module", None), nn.Module) and isinstance(
        getattr(module, "modules_to_save", None), nn.ModuleDict
    )


def adapter_settings(module: nn.Module) -> tuple:
    """What a PEFT wrapper's forward depends on besides tensors: the active adapter(s), whether adapters are
    disabled, those merged into the weights, and each adapter's scale (LoRA's ``scaling``; `set_scale`)."""
    active = getattr(module, "_active_adapter", None)
    scaling = getattr(module, "scaling", None)
    return (
        tuple(active) if isinstance(active, list) else active,
        getattr(module, "_disable_adapters", None),
        tuple(getattr(module, "merged_adapters", ())),
        tuple(scaling.items()) if isinstance(scaling, dict) else None,
    )


register_holder_kind(PEFT, is_peft_model)
register_layer_wrapper(LayerWrapper(is_adapter_layer, "base_layer", reads_inner=True, settings=adapter_settings))
register_layer_wrapper(LayerWrapper(is_modules_to_save, "original_module", settings=adapter_settings))
