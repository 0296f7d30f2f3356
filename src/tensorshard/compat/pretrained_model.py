"""The module path ``tensor_parallel.pretrained_model``: the transformers wrapper class and the preset lookup.

    from tensor_parallel.pretrained_model import find_predefined_tensor_parallel_config   # with the alias
    config = find_predefined_tensor_parallel_config(model.config, ["cuda:0", "cuda:1"])  # a Config, or None

The Config is tensorshard's preset for the model type written as rules (presets.py says how, and when there
is none).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..devices import resolve_devices
from .config import Config
from .entry import TensorParallelPreTrainedModel
from .presets import PerDevice, preset_config

__all__ = ["PerDevice", "TensorParallelPreTrainedModel", "find_predefined_tensor_parallel_config"]


def find_predefined_tensor_parallel_config(model_config: Any, device_ids: Sequence | None) -> Config | None:
    """The `Config` that splits models of `model_config`'s type over `device_ids` as tensorshard's preset does,
    or None where there is no preset or no Config expresses it (``tensor_parallel_config=None`` then does)."""
    if not hasattr(model_config, "model_type"):
        raise TypeError(
            f"find_predefined_tensor_parallel_config takes a transformers model config (model.config); got "
            f"{type(model_config).__name__}"
        )
    return preset_config(model_config, len(resolve_devices(device_ids)))
