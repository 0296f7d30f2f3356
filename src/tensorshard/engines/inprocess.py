"""The in-process engine: one Python process, one shard of the model per device, one thread per shard.

    model = TensorParallel(model, ["cuda:0", "cuda:1"])   # or tensor_parallel(...)
    loss = loss_fn(model(x), y); loss.backward(); optimizer.step()

Wrapping builds one shard per device: a copy of the module tree whose split layers hold only their
slices (as the plan says) and whose other parameters are whole copies. Each call copies the inputs to
every device, runs the shards concurrently (shard 0 in the caller's thread), and returns shard 0's
outputs on `output_device`. The whole call is one autograd graph: collectives are autograd nodes that
span the devices, so `backward()` and an optimizer over `model.parameters()` train the shards exactly like
the unsplit model (a replicated parameter gets its full gradient on every device).

Memory: the original module is consumed. Its tensors are moved into the shards one by one (so the whole
model never exists twice) and it is left on the meta device; calling it afterwards raises an error.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from typing import Any, Sequence

import torch
from torch import nn
from torch.autograd import Function
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..comm.threads import ThreadComm, ThreadGroup, enter_call
from ..devices import as_device, device_labels, resolve_devices
from ..partition import Partition
from ..plans.plan import Plan
from .sharding import ShardedModel, direct_tensors, shard_plan
from .workers import ThreadState, WorkerPool

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 300.0

_shard = threading.local()  # .rank: the shard the current thread is running


def current_rank() -> int | None:
    """The rank of the shard running in this thread, or None outside a TensorParallel call.

    Objects passed to every shard (a KV cache, say) use it to keep per-device state.
    """
    return getattr(_shard, "rank", None)


class TensorParallel(nn.Module):
    """A module split over several devices of this process.

    Args:
        module: the model to split. It is consumed: see the module docstring.
        device_ids: devices, one shard each (default: all visible GPUs, else one CPU slot). "cpu" may
            repeat to simulate several devices.
        output_device: where outputs land (default: the first device).
        plan: a `Plan` (or a ``{pattern: style}`` dict). Default: a preset for known transformers
            architectures, else a plan inferred from the model's structure.
        timeout: seconds any shard may wait at a collective before the call fails (default 300, or the
            TENSORSHARD_TIMEOUT environment variable).
        debug: run every shard on the first device, one at a time, and check that replicated outputs agree
            (also TENSORSHARD_DEBUG=1): tells a plan bug from an engine bug.
        check: self-check the plan before splitting (see `tensor_parallel`).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence | None = None,
        *,
        output_device: Any = None,
        plan: Plan | dict | None = None,
        timeout: float | None = None,
        debug: bool | None = None,
        check: bool | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"tensor_parallel() splits an nn.Module; got {type(module).__name__}")
        if isinstance(module, TensorParallel):
            raise TypeError("this module is already a TensorParallel; split the original model once")
        devices = resolve_devices(device_ids)
        self.debug = _env_flag("TENSORSHARD_DEBUG") if debug is None else bool(debug)
        self.devices = devices
        self.labels = device_labels(devices)
        self.output_device = as_device(output_device, what="output_device") if output_device is not None else devices[0]
        timeout = float(os.environ.get("TENSORSHARD_TIMEOUT", DEFAULT_TIMEOUT)) if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds; got {timeout}")
        self.timeout = timeout

        from ..plans import resolve_plan  # late import: presets and inference import the engine's styles

        world = len(devices)
        self.plan = resolve_plan(module, plan, world, check=check)
        sharded = shard_plan(module, self.plan, world)  # raises on any plan error; the model is untouched

        placement = [devices[0]] * world if self.debug else devices
        self._group = ThreadGroup(placement, timeout, serial=self.debug)
        self._pool = WorkerPool()
        # How each tensor of the original is split, by its original state-dict name (for gathered saves).
        self.splits: dict[str, tuple[int, Partition] | None] = {
            f"{m}.{t}" if m else t: sharded.split_of(tensor)
            for m, mod in module.named_modules(remove_duplicate=False)
            for _, t, tensor in direct_tensors(mod)
        }
        self.module_shards = nn.ModuleList(_build_shards(module, sharded, placement, self._group))
        self._placement = placement
        _consume(module, world)
        split = sum(1 for m in sharded.modules.values() if m.splits)
        logger.info(
            "split %s over %d device(s) %s: %d module(s) split, %d plan entries%s",
            type(module).__name__, world, self.labels, split, len(self.plan), " [debug: one device, serial]" if self.debug else "",
        )

    # -- compatibility with the tensor_parallel package --------------------------------------------------

    @property
    def tensor_parallel_config(self) -> Plan:
        return self.plan

    @property
    def world_size(self) -> int:
        return len(self.devices)

    # -- running -----------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        _check_loaded(self)
        shards, devices = self.module_shards, self._placement
        if len(shards) == 1:
            first = shards[0]
            args, kwargs = _to_device((args, kwargs), devices[0])
            _shard.rank = 0
            try:
                return _to_device(first(*args, **kwargs), self.output_device)
            finally:
                _shard.rank = None

        group = self._group
        group.reset()
        state = ThreadState.capture()
        per_rank_inputs = _replicate_inputs((args, kwargs), devices)

        def shard_call(rank: int):
            def run():
                enter_call(group)
                _shard.rank = rank
                try:
                    if group.baton is not None:
                        group.baton.acquire()
                    try:
                        with state.applied(devices[rank]):
                            a, kw = per_rank_inputs(rank)
                            return shards[rank](*a, **kw)
                    finally:
                        if group.baton is not None:
                            group.baton.release()
                except BaseException as e:
                    group.abort(e, rank)  # wake the shards waiting for this one
                    raise
                finally:
                    _shard.rank = None

            return run

        outputs = self._pool.run(
            [shard_call(r) for r in range(len(shards))],
            labels=self.labels,
            on_error=lambda e, rank: group.abort(e, rank),
            timeout=self.timeout + 5.0,
        )
        group.reset()  # drop the call's cached tensors
        src = next((r for r, d in enumerate(devices) if d == self.output_device), 0)
        return _gather_outputs(outputs, src, self.output_device, devices, self.labels, check_equal=self.debug)

    def state_dict(self, *args, **kwargs):
        """The shards' state (keys ``module_shards.N...``), or, inside ``tp.save_tensor_parallel(model)``,
        the unsplit model's state dict."""
        if getattr(self, "_gather_state_dict", False):
            from ..checkpoint.gather import gathered_state_dict

            prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
            return {prefix + k: v for k, v in gathered_state_dict(self)}
        return super().state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"devices={self.labels}, output_device={self.output_device}"

    def memory_per_device(self) -> dict[str, int]:
        """Bytes of parameters and buffers held by each device slot, in order."""
        return {label: _tensor_bytes(shard) for label, shard in zip(self.labels, self.module_shards)}


# --- building the shards ------------------------------------------------------------------------------


def _build_shards(module: nn.Module, sharded: ShardedModel, devices: list[torch.device], group: ThreadGroup) -> list[nn.Module]:
    """One copy of the module tree per device, holding local slices; the original's tensors are released."""
    world = len(devices)
    # 1. Skeletons: deep copies that share no tensor storage (each tensor maps to a meta placeholder).
    placeholders = {}
    for t in list(module.parameters()) + list(module.buffers()):
        placeholders[id(t)] = torch.empty(0, device="meta")
    shards = [copy.deepcopy(module, memo=dict(placeholders)) for _ in range(world)]
    shard_modules = [dict(s.named_modules(remove_duplicate=False)) for s in shards]

    # 2. Fill them tensor by tensor, releasing each original tensor once every device has its slice.
    made: dict[tuple[int, int], torch.Tensor] = {}
    reused: set[int] = set()
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for kind, tname, t in list(direct_tensors(mod)):
            split = sharded.split_of(t)
            for rank in range(world):
                key = (id(t), rank)
                if key not in made:
                    made[key] = _local_tensor(t, split, rank, devices[rank], kind, reused)
                target = shard_modules[rank][mod_name]
                (target._parameters if kind == "param" else target._buffers)[tname] = made[key]
            _release(mod, kind, tname, t)

    # 3. Let each style adapt its module in every shard (sizes, forward with collectives). With one device
    #    every layer is whole and runs its own forward.
    if world > 1:
        for rank in range(world):
            comm = ThreadComm(group, rank)
            for name, ms in sharded.modules.items():
                ms.style.attach(shard_modules[rank][name], ms.splits, ms.context(rank, world, comm))
    return shards


def _local_tensor(t, split, rank, device, kind, reused: set[int]):
    data = t.detach()
    if split is not None:
        dim, part = split
        data = part.take(data, dim, rank)
        local = data if data.is_meta else data.to(device, copy=True)
    elif data.is_meta:
        local = data
    elif data.device == device and id(t) not in reused:
        reused.add(id(t))  # the first device that needs a whole tensor takes over its storage
        local = data
    else:
        local = data.to(device, copy=True)
    return nn.Parameter(local, requires_grad=t.requires_grad) if kind == "param" else local


def _release(mod: nn.Module, kind: str, name: str, t: torch.Tensor) -> None:
    meta = torch.empty_like(t, device="meta")
    if kind == "param":
        mod._parameters[name] = nn.Parameter(meta, requires_grad=t.requires_grad)
    else:
        mod._buffers[name] = meta


def _consume(module: nn.Module, world: int) -> None:
    def refuse(*_):
        raise RuntimeError(
            f"this {type(module).__name__} was split over {world} device(s) by tensorshard.tensor_parallel(); its "
            "weights now live in the TensorParallel model it returned (the original is left on the meta device). "
            "Call that model, or deep-copy the original before splitting it if you need both."
        )

    module.register_forward_pre_hook(refuse)


def _check_loaded(model: TensorParallel) -> None:
    for name, p in model.named_parameters():
        if p.is_meta:
            raise RuntimeError(
                f"{name} is on the meta device: this model was built without weights. Load them first "
                "(tensorshard.load_sharded / tensorshard.from_pretrained), or build it from a model with weights."
            )


def _tensor_bytes(module: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


# --- inputs and outputs -------------------------------------------------------------------------------


class _ReplicateInput(Function):
    """Copy an input that needs a gradient to every device. Backward: under the SPMD convention every
    device holds the same, full gradient of a replicated tensor, so shard 0's is the answer."""

    @staticmethod
    def forward(ctx, devices, x):
        ctx.device = x.device
        return tuple(x.view_as(x) if d == x.device else x.to(d) for d in devices)

    @staticmethod
    def backward(ctx, *grads):
        return None, grads[0].to(ctx.device)


class _GatherOutput(Function):
    """Return shard `src`'s copy of a replicated output; backward hands the gradient to every shard."""

    @staticmethod
    def forward(ctx, src, device, devices, *ys):
        ctx.devices = devices
        y = ys[src]
        return y.view_as(y) if y.device == device else y.to(device)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, *(grad.to(d) for d in ctx.devices))


def _to_device(tree: Any, device: torch.device) -> Any:
    leaves, spec = tree_flatten(tree)
    if not any(isinstance(x, torch.Tensor) and x.device != device for x in leaves):
        return tree
    return tree_unflatten([x.to(device) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def _replicate_inputs(tree: Any, devices: list[torch.device]):
    """A function rank -> that rank's copy of the inputs (tensors moved to its device)."""
    leaves, spec = tree_flatten(tree)
    grad = torch.is_grad_enabled()
    copies = {
        i: _ReplicateInput.apply(devices, x)
        for i, x in enumerate(leaves)
        if isinstance(x, torch.Tensor) and grad and x.requires_grad
    }

    def for_rank(rank: int):
        device = devices[rank]
        local = [
            copies[i][rank] if i in copies else x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x
            for i, x in enumerate(leaves)
        ]
        return tree_unflatten(local, spec)

    return for_rank


def _gather_outputs(outputs: list, src: int, device: torch.device, devices, labels, *, check_equal: bool) -> Any:
    flats = [tree_flatten(o) for o in outputs]
    leaves, spec = flats[src]
    result = []
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            result.append(leaf)
            continue
        per_rank = [flat[0][i] for flat in flats]
        for rank, t in enumerate(per_rank):
            if not isinstance(t, torch.Tensor) or t.shape != leaf.shape:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise RuntimeError(
                    f"output leaf {i} has shape {tuple(leaf.shape)} on {labels[src]} but {shape} on {labels[rank]}: "
                    "the plan leaves an output split across devices. Gather it: gather_output=True on the last "
                    "column-parallel layer, or RowwiseParallel after it."
                )
            if check_equal and not torch.equal(t.to(leaf.device), leaf):
                raise RuntimeError(
                    f"[debug] output leaf {i} differs between {labels[src]} and {labels[rank]}: a replicated "
                    "value diverged, so the plan splits something the model mixes (a plan bug)"
                )
        if torch.is_grad_enabled() and any(t.requires_grad for t in per_rank):
            result.append(_GatherOutput.apply(src, device, devices, *per_rank))
        else:
            result.append(leaf if leaf.device == device else leaf.to(device))
    return tree_unflatten(result, spec)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
