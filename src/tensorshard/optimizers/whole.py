"""Split weights stepped whole, for optimizers whose update reads a whole tensor (kinds.PER_TENSOR: Muon, Adafactor).

    full = assemble(every device's slice)          # weight, gradient, and the state shaped like them
    optimizer's own step over `full`               # Muon: the whole momentum orthogonalized once
    every device keeps its slice of the result     # weight and state, as if it had stepped its slice

Which slice each device holds comes from the engine's `SplitLayout` (plans/slices.py): tensor-parallel splits
(uneven, fused q|k|v blocks, KV heads replicated on several devices: `Partition.assemble` / `take` put every
range back where it belongs) and ZeRO-3 partitions of replicated parameters. In one process the slices are at
hand; under torchrun every rank all-gathers each split tensor (one all-gather per tensor: weight, gradient and
the state of the same shape stacked), computes the same whole update and keeps its own slice. The torchrun
engine's "stacked" DTensor storage (comm/dtensor.py) is read and written through its unpadded view.

Optimizer state stays per device and keeps its usual shapes: state shaped like the weight is sliced like it,
a factored moment (the weight's shape with some dimensions reduced to 1: Adafactor's row and column moments) is
sliced along the split dimension unless that dimension is reduced (then every device holds the whole moment),
scalars are copied. So `optimizer.state_dict()` and `tp.save_sharded` see what they would see for AdamW.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..comm.counter import record
from ..comm.process_group import gather_partition
from ..partition import Partition
from ..plans.slices import SplitLayout

HOOK_DICTS = (  # the hook dicts torch.optim.Optimizer keeps per instance
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


@dataclass
class SplitTensor:
    """One split parameter as the optimizer sees it: its slices held here, and how they make the whole."""

    name: str  # its name in the unsplit model
    dim: int
    partition: Partition
    params: list[torch.Tensor]  # in-process: every device's parameter, in rank order; torchrun: this rank's
    ranks: list[int]  # the rank of each of `params`
    true_view: Callable[[torch.Tensor], torch.Tensor] = lambda t: t  # the real slice inside a stored tensor
    to_stored: Callable[[torch.Tensor], torch.Tensor] | None = None  # torchrun: a slice as the param's DTensor
    group: Any = None  # torchrun: the process group to gather over (None: every slice is here)
    unsupported: str = ""  # why it cannot be stepped whole here (refused before the step)

    def gather(self, locals_: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The whole tensor from the slices of `params` (each `locals_[i]` is params[i]'s, along `dim`)."""
        if self.group is None:
            device = locals_[0].device
            return self.partition.assemble([t.to(device) for t in locals_], dim)
        where = f"{self.name} (optimizer step)"
        whole = gather_partition(locals_[0], dim, self.partition, self.group, what=f"all_gather at {where}")
        record("all_gather", whole.numel() * whole.element_size(), "forward", where)  # the step counts as forward
        return whole


def split_tensors(layouts: Iterable[SplitLayout]) -> dict[int, SplitTensor]:
    """id(parameter) -> its SplitTensor, for every parameter the engines hold in slices."""
    found: dict[int, SplitTensor] = {}
    for layout in layouts:
        per_name: dict[str, SplitTensor] = {}
        for index, shard in enumerate(layout.shards):
            for name, p in shard.named_parameters(remove_duplicate=False):
                placement = layout.placements.get(name)
                if placement is None or placement[1].is_trivial or id(p) in found:
                    continue
                tensor = per_name.get(name)
                if tensor is None:
                    tensor = per_name[name] = _describe(layout, name, placement)
                if layout.state is not None and getattr(getattr(p, "device_mesh", None), "ndim", 1) != 1:
                    tensor.unsupported = (
                        "it is also sharded over a data-parallel mesh dimension (FSDP2), and the whole-weight step "
                        "gathers over the tensor-parallel dimension only; use an elementwise optimizer (AdamW) there"
                    )
                tensor.params.append(p)
                tensor.ranks.append(index if layout.state is None else layout.state.comm.rank)
                found[id(p)] = tensor
    return found


def _describe(layout: SplitLayout, name: str, placement) -> SplitTensor:
    dim, partition = placement
    if layout.state is None:  # in-process: each device's parameter is a plain tensor holding its slice
        return SplitTensor(name, dim, partition, [], [])
    state = layout.state  # torchrun: a DTensor (or plain tensor) storing this rank's slice, maybe padded
    stored = state.layouts[name]

    def true_view(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t
        return stored.view(local)

    def to_stored(t: torch.Tensor) -> torch.Tensor:
        return stored.to_dtensor(t, state.mesh)

    return SplitTensor(name, dim, partition, [], [], true_view, to_stored, state.comm.group)


# --- the step ---------------------------------------------------------------------------------------------


def step_whole(optimizer: torch.optim.Optimizer, groups: list[dict], tensors: list[list[SplitTensor]]) -> list[torch.Tensor]:
    """Step each of `tensors[i]` (split tensors of param group `groups[i]` that have gradients) whole, with the
    optimizer's own step. Returns the parameters stepped (their gradients are to be hidden from the rest of
    the step)."""
    stepped = []
    for group, split in zip(groups, tensors):
        for t in split:  # one at a time: a single whole weight (with its gradient and state) exists at once
            whole, state = _assemble(optimizer, t)
            state = run_own_step(optimizer, [{**group, "params": [whole]}], {whole: state} if state else {})
            _keep_slices(optimizer, t, whole, state.get(whole, {}))
            stepped.extend(t.params)
    return stepped


def run_own_step(optimizer: torch.optim.Optimizer, groups: list[dict], state: dict | None = None) -> dict:
    """The optimizer's own step (its class's, without torch's hook wrapper: hooks fire once, around the whole
    step) over `groups`, on a shallow copy that shares its defaults and options. With `state` (a dict
    {param: state}), the copy steps with that state and returns it; without, it shares the optimizer's."""
    part = object.__new__(type(optimizer))
    part.__dict__.update(optimizer.__dict__)
    part.param_groups = groups
    if state is not None:
        part.state = defaultdict(dict, state)
    for name in HOOK_DICTS:
        setattr(part, name, OrderedDict())
    step = type(optimizer).step
    step = step.__wrapped__ if getattr(step, "hooked", False) else step  # torch's hook wrapper, undone
    step(part)
    return part.state


def _assemble(optimizer: torch.optim.Optimizer, t: SplitTensor) -> tuple[nn.Parameter, dict]:
    """The whole parameter (its gradient set) and its whole state, from the slices."""
    weights = [t.true_view(p.detach()) for p in t.params]
    grads = [t.true_view(p.grad) for p in t.params]
    states = [{k: _local_state(t, v) for k, v in optimizer.state.get(p, {}).items()} for p in t.params]
    local_shape = weights[0].shape
    # Gathered together: the weight, its gradient and every state of the same shape and dtype (one collective).
    together = [k for k, v in states[0].items() if _is_tensor(v) and v.shape == local_shape and v.dtype == weights[0].dtype]
    stacks = [torch.stack([w, g, *(st[k] for k in together)]) for w, g, st in zip(weights, grads, states)]
    whole_stack = t.gather(stacks, t.dim + 1)
    whole = nn.Parameter(whole_stack[0].clone(), requires_grad=t.params[0].requires_grad)
    whole.grad = whole_stack[1].clone()
    state: dict[str, Any] = {k: whole_stack[2 + i].clone() for i, k in enumerate(together)}
    for key, value in states[0].items():
        if key in state:
            continue
        if _is_tensor(value) and _sliced(value.shape, local_shape, t.dim):
            state[key] = t.gather([st[key] for st in states], t.dim).clone()
        else:  # a scalar (step), or a factored moment reduced along the split dimension: the same everywhere
            state[key] = value.clone() if _is_tensor(value) else value
    return whole, state


def _keep_slices(optimizer: torch.optim.Optimizer, t: SplitTensor, whole: torch.Tensor, state: dict) -> None:
    """Every slice of `t` held here takes its part of the stepped `whole` and of its state."""
    for p, rank in zip(t.params, t.ranks):
        with torch.no_grad():
            t.true_view(p.detach()).copy_(t.partition.take(whole.detach(), t.dim, rank))
        mine = {}
        for key, value in state.items():
            if not _is_tensor(value):
                mine[key] = value
            elif value.dim() and _sliced(value.shape, whole.shape, t.dim):
                piece = t.partition.take(value, t.dim, rank).to(p.device).clone()
                if value.shape == whole.shape and t.to_stored is not None:
                    piece = t.to_stored(piece)  # as torch keeps AdamW's moments of a DTensor: a DTensor like it
                mine[key] = piece
            else:
                mine[key] = value.to(p.device).clone()
        optimizer.state[p] = mine


def _sliced(shape: torch.Size, param_shape: torch.Size, dim: int) -> bool:
    """True for state shaped like the parameter, or like it with other dimensions than `dim` reduced to 1."""
    if len(shape) != len(param_shape) or shape[dim] != param_shape[dim]:
        return False
    return all(s in (n, 1) for s, n in zip(shape, param_shape))


def _local_state(t: SplitTensor, value: Any) -> Any:
    """A state value as a plain tensor of this slice (torchrun keeps state shaped like a DTensor weight as one)."""
    return t.true_view(value) if hasattr(value, "to_local") else value


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)
