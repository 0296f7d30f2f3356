"""The front door: `tensor_parallel` (one process, a list of devices), `parallelize` (under torchrun) and
`from_pretrained` (build empty, split, stream the weights in). Everything else sits below this module."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch
from torch import nn

from . import plan_inference  # noqa: F401 - registers the automatic plan and the self-check with plans.resolve_plan
from . import quant
from .checkpoint.streaming import load_pretrained
from .devices import resolve_devices
from .engines.inprocess import TensorParallel
from .engines.inprocess.zero import default_sharded
from .engines.resplit import refuse_split_twice
from .engines.torchrun import parallelize, tensor_parallel_distributed
from .model_kind import model_kind
from .plans.balance import check_balance
from .plans.plan import Plan

__all__ = ["from_pretrained", "parallelize", "tensor_parallel"]


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
    balance: bool = False,
) -> nn.Module:
    """Split `module` over devices, tensor-parallel.

    In one process (the default): ``tensor_parallel(model, ["cuda:0", "cuda:1"])`` returns a
    `TensorParallel` holding one shard per device, which trains and runs like the original. The original
    module is consumed (its weights move into the shards; it is left on the meta device). A transformers
    `PreTrainedModel` comes back as an instance of its own class too, with ``generate``, ``config`` and
    ``save_pretrained`` (see docs/transformers.md).

    Args:
        device_ids: devices for the shards, in order: a list or tuple of names, `torch.device`s or GPU indices
            ('cpu' may repeat; default: all visible GPUs, else one CPU slot). A dict or a set is refused.
        output_device: where outputs land (default: the first device).
        plan: a `Plan` or ``{pattern: style}`` dict; default: a preset, else an inferred plan.
        tensor_parallel_config: the tensor_parallel package's name for `plan`; also takes its rules, as a
            `tensorshard.compat.Config` (docs/migrating.md).
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
        balance: even out each device's weights over every block whose attention heads split unevenly (3 KV
            heads over 2 devices): the MLP beside such an attention gets per-device sizes that make up the
            difference (plans/balance.py; docs/plans.md). Default off: even splits.
    """
    check_balance(balance)
    if plan is not None and tensor_parallel_config is not None:
        raise ValueError("pass either plan= or tensor_parallel_config= (its old name), not both")
    plan = plan if plan is not None else tensor_parallel_config
    if isinstance(module, nn.Module):
        refuse_split_twice(module)  # before a transformers model's split class is built from a split one
    if distributed:
        return tensor_parallel_distributed(module, device_ids, plan=plan, sharded=sharded, timeout=timeout, balance=balance)
    if sharded is False and sharded_param_names:
        raise ValueError("sharded_param_names lists parameters for ZeRO-3, but sharded=False turns it off; drop one")
    if sharded is None:
        # Default: on when training (train mode, trainable parameters, 2+ devices); see engines/inprocess/zero.py.
        device_ids = resolve_devices(device_ids)  # once: None warns on a machine without GPUs
        sharded = bool(sharded_param_names) or (isinstance(module, nn.Module) and default_sharded(module, len(device_ids)))
    options = dict(
        output_device=output_device, plan=plan, timeout=timeout, debug=debug,
        sharded=bool(sharded), sharded_param_names=sharded_param_names, check=check, balance=balance,
    )
    kind = model_kind(module)  # asked once here; the steps below read the answer (model_kind.py)
    if not kind.holds_transformers_model:
        return TensorParallel(module, device_ids, kind=kind, **options)
    # deferred: the integration imports transformers, an optional heavy dependency (loaded already here)
    from .integrations.transformers import tensor_parallel_transformers

    return tensor_parallel_transformers(module, kind, device_ids, **options)


def from_pretrained(
    path: str | os.PathLike,
    device_ids: Sequence | None = None,
    *,
    mesh: Any = None,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    plan: Plan | dict | None = None,
    dtype: torch.dtype | None = None,
    sharded: bool | None = None,
    sharded_param_names: Sequence[str] | None = None,
    gguf_file: str | None = None,
    output_device: Any = None,
    timeout: float | None = None,
    progress: bool = True,
    quantization_config: Any = None,
    balance: bool = False,
) -> nn.Module:
    """Build a tensor-parallel model and stream its weights from `path` into the devices.

    Args:
        path: a folder of safetensors files (Hugging Face layout with ``config.json``, a tensorshard sharded
            checkpoint, or a torch.distributed.checkpoint folder), a ``.safetensors`` file, or a ``.gguf`` file.
        device_ids: the devices, as for `tensor_parallel` (the in-process engine).
        mesh: under torchrun, the 1-D tensor-parallel DeviceMesh (instead of `device_ids`): every process
            calls ``from_pretrained(path, mesh=mesh, ...)``, the model is split in place by `parallelize` and
            returned as the module itself; each process reads only its rank's slices.
        model: the model to fill: a module (ideally built on the meta device, e.g. under
            ``tp.checkpoint.empty_weights()``) or a function that builds one (called under it). Default: the
            transformers model that ``config.json`` (or the GGUF metadata) describes, in eval mode, as
            transformers' from_pretrained returns it.
        plan: as for `tensor_parallel` (default: the plan a tensorshard checkpoint was saved with, else a
            preset, else an inferred plan). A stored plan that does not fit the model is an error naming
            the patterns that match nothing.
        dtype: dtype of the floating-point weights (default: the checkpoint's for transformers models; the
            model's own otherwise). Weights are cast on the way in.
        sharded, sharded_param_names: ZeRO-3 for replicated parameters, as for `tensor_parallel` (in-process
            only; under torchrun use FSDP2 on a data-parallel mesh, docs/checkpoints.md).
        gguf_file: the GGUF file's name inside the folder `path` (or give the file as `path`).
        output_device, timeout: as for `tensor_parallel` (in-process only).
        progress: show a tqdm progress bar (under torchrun: on global rank 0).
        quantization_config: a transformers ``BitsAndBytesConfig`` (4-bit or 8-bit; in-process only): the
            model gets bitsandbytes layers and each device's slices are quantized on that device as they are
            read, so no device ever holds more than its quantized share plus one slice in full precision
            (docs/quantization.md).
        balance: a balanced split, as for `tensor_parallel` (both engines).

    Peak host memory: one device's share plus the largest tensor (see checkpoint/streaming.py).
    """
    check_balance(balance)
    if mesh is not None:
        given = [k for k, v in (("device_ids", device_ids), ("sharded", sharded), ("sharded_param_names",
                 sharded_param_names), ("output_device", output_device), ("timeout", timeout)) if v]
        if given:
            raise ValueError(
                f"from_pretrained(mesh=...) loads under torchrun, one process per device; {', '.join(given)} "
                "belong to the in-process engine. Drop them (ZeRO-3 under torchrun is FSDP2's fully_shard on a "
                "data-parallel mesh, applied after loading)."
            )
    if quantization_config is not None:
        quant.check_config(quantization_config)
        if mesh is not None:
            raise NotImplementedError(
                "from_pretrained(mesh=..., quantization_config=...): the torchrun engine (DTensor) cannot hold "
                "quantized weights; load in one process with a list of devices (docs/quantization.md)"
            )
    if mesh is not None:
        def split(module: nn.Module, plan) -> nn.Module:  # in place; meta stays meta, so nothing to broadcast
            return parallelize(module, mesh, plan, src_data_rank=None, balance=balance)
    else:
        def split(module: nn.Module, plan) -> nn.Module:
            return tensor_parallel(
                module, device_ids, output_device=output_device, plan=plan, sharded=sharded,
                sharded_param_names=sharded_param_names, timeout=timeout, balance=balance,
            )
    return load_pretrained(
        path, split, in_place=mesh is not None, model=model, plan=plan, dtype=dtype, gguf_file=gguf_file, progress=progress,
        quantization_config=quantization_config,
    )
