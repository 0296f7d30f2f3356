"""An optimizer step that runs per device, in the shards' threads, for models split in one process.

    optimizer = tp.per_device_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-5), model)
    loss.backward(); optimizer.step(); optimizer.zero_grad()

A torch.optim optimizer steps in the caller's thread over every parameter it holds: over a model split in
one process that is every shard's parameters, one after another. On CPU slots a plain torch.optim optimizer
already steps per device by default (default_step.py, which uses `DeviceSteps` below); `per_device_optimizer`
does it explicitly, also for a subclass with its own `step()`, a closure, the optimizer's own step hooks, and
on GPUs. It returns an ordinary
`torch.optim.Optimizer` whose `step()` runs the wrapped optimizer's own step once per shard, over that
shard's parameters, in that shard's thread, all shards at once (the engine's workers, time limit and
failure handling, as for a forward call). The update of AdamW, Adam, SGD and the other torch.optim
optimizers is the same per parameter whichever other parameters share its step, so the result is bit-identical
to the wrapped optimizer's. On GPUs each device's kernels already run asynchronously; the threads add little.

What stays the wrapped optimizer's: `param_groups`, `state` and `defaults` (the same objects, so an LR
scheduler, `clip_grad_norm_` or code holding the original sees every change), `state_dict()` and
`load_state_dict()` (the same format: checkpoints move between the two, and tp.save_sharded takes either),
`zero_grad()`, `add_param_group()`, and its hooks (the same dicts: a step hook registered on either fires
once per step, with this optimizer as its argument). A closure is evaluated once in the caller's thread
before the per-device step, as AdamW and SGD do. Parameters no shard holds (a head added outside the split
model) step in the caller's thread, and so does a step called from inside one of the model's shards (a
gradient hook stepping one parameter's optimizer during backward).

Split weights of an optimizer that reads a whole weight (Muon, Adafactor) are stepped whole first, after the
closure (tensorshard/optimizers). Not for optimizers whose step couples parameters (LBFGS flattens them all into one vector: refused) or that
write into their param groups during `step()`.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

from ...logs import get_logger
from ...optimizers import step_split_whole
from ...optimizers.kinds import inner_optimizer
from ...optimizers.whole import HOOK_DICTS, run_own_step
from .engine import TensorParallel
from .workers import ThreadState

logger = get_logger(__name__)

_COUPLED = (torch.optim.LBFGS,)  # step() works on all parameters at once


def per_device_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    """`optimizer`, stepping each device's parameters in that device's thread (see this module's docstring).

    `model` is the split model (or any module holding in-process split models: a PeftModel, a Lightning
    module). Without one (an unsplit model, or the torchrun engine's, where every rank steps its own
    parameters already) `optimizer` is returned as it is.
    """
    if isinstance(optimizer, PerDeviceOptimizer):
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"per_device_optimizer() takes a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"per_device_optimizer(optimizer, model): model must be the split model (an nn.Module); got "
            f"{type(model).__name__}"
        )
    inner = inner_optimizer(optimizer)
    if inner is not None and not isinstance(optimizer, PerDeviceOptimizer):
        raise TypeError(
            f"per_device_optimizer() got {type(optimizer).__name__}, a wrapper that hands its step to the "
            f"{type(inner).__name__} inside it; its step cannot run once per device. Make the per-device optimizer "
            f"first and wrap that: per_device_optimizer({type(inner).__name__}(...), model), then give it to the "
            "library that wraps it (accelerator.prepare(...), Lightning's configure_optimizers)."
        )
    if isinstance(optimizer, _COUPLED):
        raise TypeError(
            f"{type(optimizer).__name__} cannot step per device: its step() treats all parameters as one vector "
            "(and re-evaluates the closure). Use it as it is; its step then runs in the caller's thread."
        )
    models = [m for m in model.modules() if isinstance(m, TensorParallel)]
    if not any(m.world_size > 1 for m in models):
        logger.info("per_device_optimizer: %s holds no model split over several devices in this process; the "
                    "optimizer is returned as it is", type(model).__name__)
        return optimizer
    return PerDeviceOptimizer(optimizer, models)


class PerDeviceOptimizer(torch.optim.Optimizer):
    """The wrapped optimizer, with a `step()` that runs per device. Made by `per_device_optimizer`."""

    def __init__(self, optimizer: torch.optim.Optimizer, models: list[TensorParallel]) -> None:
        # Not Optimizer.__init__: the groups, the state and the hooks are the wrapped optimizer's own objects.
        self.optimizer = optimizer
        self._steps = DeviceSteps(optimizer, models)
        for name in HOOK_DICTS:
            setattr(self, name, getattr(optimizer, name))
        self._patch_step_function()  # step() fires the (shared) step hooks, once per step

    # -- the wrapped optimizer's state, shared -------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, state) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __getstate__(self):
        raise TypeError(
            "a PerDeviceOptimizer cannot be pickled (it refers to the split model's threads): save "
            "optimizer.state_dict(), or tp.save_sharded(model, path, optimizer=optimizer)"
        )

    def __repr__(self) -> str:
        return f"PerDeviceOptimizer({self.optimizer!r})"

    # -- the step ------------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The wrapped optimizer's step, each device's parameters in its shard's thread. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Split weights the optimizer must see whole (Muon, Adafactor) first, their gradients hidden meanwhile
        # from the per-device step (tensorshard/optimizers/guard.py); a refused optimizer raises here.
        whole = [(p, p.grad) for p in step_split_whole(self.optimizer, self._steps.models)[0]]
        try:
            for p, _ in whole:
                p.grad = None
            self._steps.run(self.optimizer.param_groups)
        finally:
            for p, grad in whole:
                p.grad = grad
        self.optimizer._opt_called = True  # an LR scheduler built on the wrapped optimizer sees its step
        return loss


def _owners(models: list[TensorParallel]) -> dict[int, tuple[weakref.ref, int, int]]:
    owners: dict[int, tuple[weakref.ref, int, int]] = {}
    groups: dict[int, int] = {}  # id(ThreadGroup) -> index of the first model using it (a view shares its model's)
    for index, model in enumerate(models):
        index = groups.setdefault(id(model._group), index)
        for rank, shard in enumerate(model.module_shards):
            for p in shard.parameters():
                owners.setdefault(id(p), (weakref.ref(p), index, rank))
    return owners


class DeviceSteps:
    """Runs an optimizer's own step once per shard, over that shard's parameters, in the shards' threads.

    The optimizer's `step` (its class's, without torch's hook wrapper: the hooks fire once, around the whole
    step) runs on a shallow copy of the optimizer that shares its state, defaults and options but holds only
    one shard's parameters. Used by `PerDeviceOptimizer` and by the default step of plain optimizers
    (default_step.py).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, models: list[TensorParallel]) -> None:
        self.optimizer = optimizer
        self.models = models
        self._owners: dict[int, tuple[weakref.ref, int, int]] = {}  # id(param) -> (param, model index, rank)

    def run(self, param_groups: list[dict[str, Any]], *, rest: bool = True) -> list[torch.Tensor]:
        """Step `param_groups`: each owned parameter in its shard's thread, the others (unless not `rest`) in this
        one. Returns the parameters stepped in the shards' threads."""
        per_model, unowned = self._split_groups(param_groups)
        state = ThreadState.capture()
        stepped: list[torch.Tensor] = []
        for index, per_rank in per_model.items():
            model = self.models[index]
            devices = model._placement
            if model._group.running_here():
                # Inside one of the model's own shards (a gradient hook stepping an optimizer per parameter, as in
                # "optimizer in backward"): that shard's thread is the right one; the others are busy in this call.
                self.step_groups([group for groups in per_rank for group in groups])
                continue

            def run(rank: int, per_rank=per_rank, devices=devices) -> None:
                with state.applied(devices[rank]):
                    self.step_groups(per_rank[rank])

            model._run_shards("optimizer step", run)
            stepped.extend(p for groups in per_rank for group in groups for p in group["params"])
        if rest and unowned:
            self.step_groups(unowned)
        return stepped

    def step_groups(self, groups: list[dict[str, Any]]) -> None:
        """The optimizer's own step (without its hooks: they fire once, around the whole step) over `groups`."""
        if groups:
            run_own_step(self.optimizer, groups)  # same state, defaults and options, over some parameters

    def _split_groups(self, param_groups: list[dict[str, Any]]) -> tuple[dict[int, list[list[dict]]], list[dict]]:
        """Every param group cut by owner: {model index: [rank's groups]}, and the groups of unowned parameters."""
        per_model: dict[int, list[list[dict]]] = {}
        rest: list[dict] = []
        for group in param_groups:
            cut: dict[tuple[int, int], list] = {}
            for p in group["params"]:
                cut.setdefault(self.owner(p), []).append(p)
            for (index, rank), params in cut.items():
                piece = {**group, "params": params}
                if index < 0:
                    rest.append(piece)
                else:
                    world = len(self.models[index].module_shards)
                    per_model.setdefault(index, [[] for _ in range(world)])[rank].append(piece)
        return per_model, rest

    def owner(self, p: torch.Tensor) -> tuple[int, int]:
        """(model index, rank) of the shard holding `p`, or (-1, 0) when none does."""
        entry = self._owners.get(id(p))
        if entry is None or entry[0]() is not p:
            self._owners = _owners(self.models)  # parameters changed since (ZeRO-3 applied later, adapters)
            entry = self._owners.get(id(p))
            if entry is None:
                self._owners[id(p)] = entry = (weakref.ref(p), -1, 0)
        return entry[1], entry[2]
