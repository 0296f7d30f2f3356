"""`tensor_parallel()`: the one-line entry point, with the keyword names of the tensor_parallel package."""

from __future__ import annotations

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
    module is consumed (its weights move into the shards; it is left on the meta device).

    Args:
        device_ids: devices for the shards (default: all visible GPUs, else one CPU slot).
        output_device: where outputs land (default: the first device).
        plan: a `Plan` or ``{pattern: style}`` dict; default: a preset, else an inferred plan.
        tensor_parallel_config: the tensor_parallel package's name for `plan`.
        distributed: run under torchrun, one process per device (see `tensorshard.parallelize`).
        sharded: ZeRO-3 partitioning of the parameters the plan leaves whole.
        sharded_param_names: which parameters `sharded` partitions (default: all replicated trainable ones).
        timeout: seconds a shard may wait at a collective before the call fails.
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
    if sharded or sharded_param_names:
        raise NotImplementedError("sharded=True (ZeRO-3 for replicated parameters) is not available yet")
    return TensorParallel(
        module, device_ids, output_device=output_device, plan=plan, timeout=timeout, debug=debug, check=check
    )
