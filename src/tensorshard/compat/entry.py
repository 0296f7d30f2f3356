"""The tensor_parallel package's entry points, with its argument names and defaults, on tensorshard's engines.

    tensor_parallel(model, ["cuda:0", "cuda:1"], tensor_parallel_config=config)   # one process
    tensor_parallel(model, distributed=True)                                       # under torchrun
    TensorParallel(model, device_ids, output_device_index=1)                       # the class, sharded=True
    TensorParallelPreTrainedModel(hf_model, device_ids)                            # a transformers model
    Sharded(model)  /  model.apply_sharding()                                      # ZeRO-3, after splitting

What they return are tensorshard's own models: a `tensorshard.TensorParallel`, or for a transformers
model (or a PeftModel around one) an instance of its own class that is also one (``isinstance(m,
TensorParallel)`` and ``isinstance(m, TensorParallelPreTrainedModel)`` hold, as with the original). Under
torchrun the split module comes back, not the original's ``(module, names)`` tuple. A `Config` is translated
for the device count when the engine resolves the plan, before the model changes (translate.py); a
tensorshard `Plan` is accepted as is. The module given stays usable, as with the original, unless
``consume=True`` (keep.py says what that costs).
"""

from __future__ import annotations

import re
import sys
from typing import Any, Collection, Sequence

import torch
from torch import nn

import tensorshard as ts
from ..devices import resolve_devices
from ..integrations.peft.recognised import PEFT, is_peft_class
from ..logs import get_logger
from ..model_kind import TRANSFORMERS, model_kind
from .config import Config
from .keep import split_copy, split_keeping

logger = get_logger(__name__)


def tensor_parallel(
    module: nn.Module,
    device_ids: Sequence | None = None,
    tensor_parallel_config: Config | ts.Plan | dict | None = None,
    distributed: bool | None = None,
    sharded: bool | None = None,
    sharded_param_names: Collection[str] | None = None,
    *,
    consume: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """Split `module`, tensor-parallel, as ``tensor_parallel.tensor_parallel`` did.

    Args:
        device_ids: the devices (default: every visible GPU, else one CPU slot).
        tensor_parallel_config: a `Config` (translated for this device count), a tensorshard `Plan`, or
            None: tensorshard's preset for known transformers architectures, else an inferred plan.
        distributed: one process per device under torchrun (default: when torch.distributed is
            initialised, as in the original). Returns the split module.
        sharded: ZeRO-3 for the parameters the plan leaves whole. Default: tensorshard's, on when training
            (train mode, trainable parameters, 2+ devices), off for ``eval()`` models and models on the meta
            device (call ``model.apply_sharding()`` once the weights are loaded).
        sharded_param_names: which of those to partition, by the unsplit model's parameter names.
        consume: False (the original's behaviour): `module` stays as it was, and the split model holds its own
            copies of the weights. True (tensorshard's): the weights move into the split model, which saves
            one copy of them; `module` is left empty, on the meta device (under torchrun: split in place).
        kwargs: output_device, output_device_index, and tensorshard's options (timeout, debug, check).
    """
    if distributed is None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed:  # a Config is translated for the job's world size by the torchrun engine
        def split(m: nn.Module) -> nn.Module:
            return ts.tensor_parallel(m, device_ids, plan=tensor_parallel_config, distributed=True, sharded=sharded, **kwargs)

        return split(module) if _consume(consume) else split_copy(module, split)
    return _split(module, device_ids, tensor_parallel_config, sharded, sharded_param_names, consume=consume, **kwargs)


class _Alias(type):
    """A class standing for a tensorshard class: calling it splits a model, isinstance checks the target."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return cls._is_one(type(obj))

    def __subclasscheck__(cls, sub: type) -> bool:
        return cls._is_one(sub)


class TensorParallel(metaclass=_Alias):
    """``TensorParallel(module, device_ids, ...)``: the original class's arguments and defaults (ZeRO-3 on).

    ``delay_init`` (shards kept on the CPU until the first call) and ``distributed`` (the original's choice of
    collectives inside the wrapper) are accepted and have no effect: shards are built on their devices, and
    the collectives are the engine's own. ``consume=True`` moves the weights instead of copying them (see
    `tensor_parallel`). Returns a `tensorshard.TensorParallel`.
    """

    @staticmethod
    def _is_one(cls: type) -> bool:
        return issubclass(cls, ts.TensorParallel)

    def __new__(
        cls,
        module: nn.Module,
        device_ids: Sequence | None = None,
        output_device: Any = None,
        output_device_index: int | None = None,
        tensor_parallel_config: Config | ts.Plan | dict | None = None,
        delay_init: bool = False,
        distributed: bool = True,
        sharded: bool = True,
        sharded_param_names: Collection[str] | None = None,
        **kwargs: Any,
    ):
        return _split(
            module, device_ids, tensor_parallel_config, sharded, sharded_param_names, output_device=output_device,
            output_device_index=output_device_index, engine=ts.TensorParallel, **kwargs,
        )


class TensorParallelPreTrainedModel(metaclass=_Alias):
    """``TensorParallelPreTrainedModel(model, device_ids, ...)``: a transformers model, or a PeftModel around one
    (LoRA added first, then split), split with the original's defaults (ZeRO-3 on). The result is an instance
    of the model's own class too (``generate``, ``save_pretrained``; a PeftModel's adapter format), with its
    parameters under ``module_shards.N``; ``model.wrapped_model`` is the model itself (the original's
    ``wrapped_model.`` level does not exist)."""

    @staticmethod
    def _is_one(cls: type) -> bool:  # a split transformers or PEFT model (without importing either here)
        return issubclass(cls, ts.TensorParallel) and (_is_transformers_class(cls) or is_peft_class(cls))

    def __new__(
        cls,
        module: nn.Module,
        device_ids: Sequence | None = None,
        output_device: Any = None,
        output_device_index: int | None = None,
        tensor_parallel_config: Config | ts.Plan | dict | None = None,
        sharded: bool = True,
        sharded_param_names: Collection[str] | None = None,
        **kwargs: Any,
    ):
        if model_kind(module).name not in (TRANSFORMERS, PEFT):  # the front door's own sorting (model_kind.py)
            raise TypeError(
                f"TensorParallelPreTrainedModel splits a transformers PreTrainedModel, or a PeftModel around one; got "
                f"{type(module).__name__}. Use TensorParallel(...) or tensor_parallel(...) for other modules."
            )
        kwargs.pop("delay_init", None)
        kwargs.pop("distributed", None)
        return _split(
            module, device_ids, tensor_parallel_config, sharded, sharded_param_names, output_device=output_device,
            output_device_index=output_device_index, **kwargs,
        )


def Sharded(module: nn.Module, sharded_param_names: Collection[str] | None = None) -> nn.Module:  # noqa: N802
    """The original's ``Sharded(model)``: ZeRO-3 of what the plan leaves whole, applied to a split model in
    place; returns it (the same as ``model.apply_sharding(sharded_param_names)``)."""
    if not isinstance(module, ts.TensorParallel):
        raise TypeError(f"Sharded() takes a model split by tensor_parallel(); got {type(module).__name__}")
    module.apply_sharding(original_names(sharded_param_names))
    return module


def original_names(names: Collection[str] | None) -> list[str] | None:
    """The unsplit model's names for parameter names as the original spelled them: it accepted names from
    inside a shard, with ``tp_wrapped_module.`` levels and ``wrapped_model.module_shards.N.`` prefixes."""
    if names is None:
        return None
    if isinstance(names, str):
        raise TypeError(f"sharded_param_names must be a list of parameter names; got the string {names!r}")
    out = []
    for name in names:
        name = re.sub(r"^(wrapped_model\.)?(module_shards\.\d+\.)?", "", name).replace("tp_wrapped_module.", "")
        if name not in out:
            out.append(name)
    return out


# --- shared by the entry points -----------------------------------------------------------------------------


def _split(module, device_ids, config, sharded, names, *, output_device=None, output_device_index=None,
           engine=None, consume=False, **kwargs) -> nn.Module:
    if not isinstance(module, nn.Module):
        raise TypeError(f"tensor_parallel() splits an nn.Module; got {type(module).__name__}")
    consume = _consume(consume)
    kwargs.pop("delay_init", None)
    devices = resolve_devices(device_ids)
    if output_device is not None and output_device_index is not None:
        raise ValueError("pass output_device or output_device_index, not both")
    if output_device_index is not None:
        if not 0 <= output_device_index < len(devices):
            raise ValueError(f"output_device_index={output_device_index}, but there are {len(devices)} devices")
        output_device = devices[output_device_index]
    if sharded is False and names:
        raise ValueError("sharded_param_names lists parameters for ZeRO-3, but sharded=False turns it off; drop one")
    names = original_names(names)
    if sharded is not False and _on_meta(module):  # ZeRO-3 of empty weights would leave nothing to load into
        if sharded:
            logger.info(
                "%s holds tensors on the meta device: ZeRO-3 (sharded=True) waits until the weights are loaded; "
                "call model.apply_sharding() then", type(module).__name__,
            )
        sharded, names = False, None
    # A Config is translated for the device count when the engine resolves the plan, before the model changes.
    options = dict(output_device=output_device, plan=config, sharded=sharded, sharded_param_names=names, **kwargs)

    def split(m: nn.Module) -> nn.Module:
        if engine is not None:  # the class: a plain TensorParallel even for a transformers model, as the original
            return engine(m, devices, **{**options, "sharded": bool(sharded)})
        return ts.tensor_parallel(m, devices, **options)

    return split(module) if consume else split_keeping(module, split)


def _consume(consume: Any) -> bool:
    if not isinstance(consume, bool):
        raise TypeError(
            f"consume must be True (the weights move into the split model) or False (the module stays as it was, "
            f"the original's behaviour); got {consume!r}"
        )
    return consume


def _is_transformers_class(cls: type) -> bool:
    transformers = sys.modules.get("transformers")  # a model of it means it is imported
    return transformers is not None and issubclass(cls, transformers.PreTrainedModel)


def _on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))
