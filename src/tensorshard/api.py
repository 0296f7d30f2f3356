"""`tensor_parallel()`: the one-line entry point, with the keyword names of the tensor_parallel package."""

from __future__ import annotations

import sys
from typing import Any, Sequence

from torch import nn

from .engines.inprocess import TensorParallel
from .plans.plan import Plan


def tensor_parallel(
    module: nn.Module,
    device_ids: Sequence | None = None,
    *,
    output_device: Any = None,
    plan: Plan | dict | None = None,
    tensor_parallel_config: Plan | dict | None = None,
    distributed: bool | None = None,
    sharded: bool | None = None,
    sharded_param_names: Sequence[str] | None = None,
    timeout: float | None = None,
    debug: bool | None = None,
    check: bool | None = None,
) -> nn.Module:
    """Split `module` over devices, tensor-parallel.

    In one process (the default): ``tensor_parallel(model, ["cuda:0", "cuda:1"])`` returns a
    `TensorParallel` holding one shard per device, which trains and runs like the original. The original
    module is consumed (its weights move into the shards; it is left on the meta device). A transformers
    `PreTrainedModel` comes back as an instance of its own class too, with ``generate``, ``config`` and
    ``save_pretrained`` (see docs/transformers.md).

    Args:
        device_ids: devices for the shards (default: all visible GPUs, else one CPU slot).
        output_device: where outputs land (default: the first device).
        plan: a `Plan` or ``{pattern: style}`` dict; default: a preset, else an inferred plan.
        tensor_parallel_config: the tensor_parallel package's name for `plan`.
        distributed: run under torchrun, one process per device (see `tensorshard.parallelize`).
        sharded: ZeRO-3 for the parameters the plan leaves whole (norms, biases, small layers): each device
            keeps 1/N of them, of their gradients and of their optimizer state; they are gathered once per
            forward call. Default (None): on when training, i.e. the module is in train mode, has trainable
            parameters and there are 2+ devices; off for ``model.eval()`` models (inference, generation).
        sharded_param_names: which replicated parameters `sharded` partitions, by original name (default:
            every trainable one with at least as many rows as devices). Implies ``sharded=True``.
        timeout: seconds a shard may wait at a collective before the call fails (default 300, or
            TENSORSHARD_TIMEOUT). docs/errors.md lists what each failure raises.
        debug: run all shards on one device, one at a time (also TENSORSHARD_DEBUG=1).
        check: verify the plan numerically, region by region, before splitting (docs/automatic-plans.md);
            regions that fail stay whole. Default: on for inferred plans, off for presets and given plans.
    """
    if plan is not None and tensor_parallel_config is not None:
        raise ValueError("pass either plan= or tensor_parallel_config= (its old name), not both")
    plan = plan if plan is not None else tensor_parallel_config
    if distributed:
        from .engines.torchrun import tensor_parallel_distributed

        return tensor_parallel_distributed(module, device_ids, plan=plan, sharded=sharded, timeout=timeout)
    if sharded is False and sharded_param_names:
        raise ValueError("sharded_param_names lists parameters for ZeRO-3, but sharded=False turns it off; drop one")
    if sharded is None:
        # Default: on when training (train mode, trainable parameters, 2+ devices); see engines/zero.py.
        from .devices import resolve_devices
        from .engines.zero import default_sharded

        sharded = bool(sharded_param_names) or (
            isinstance(module, nn.Module) and default_sharded(module, len(resolve_devices(device_ids)))
        )
    options = dict(
        output_device=output_device, plan=plan, timeout=timeout, debug=debug,
        sharded=bool(sharded), sharded_param_names=sharded_param_names, check=check,
    )
    if _is_transformers_model(module):  # still an instance of its class: generate, save_pretrained, ...
        from .integrations.transformers import tensor_parallel_pretrained

        model = tensor_parallel_pretrained(module, device_ids, **options)
    else:
        model = TensorParallel(module, device_ids, **options)
    return model


def _is_transformers_model(module: Any) -> bool:
    transformers = sys.modules.get("transformers")  # never import it for a plain PyTorch model
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)
