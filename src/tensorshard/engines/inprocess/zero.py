"""ZeRO-3 for what the plan leaves whole: each device keeps 1/N of every replicated parameter.

    model = tp.tensor_parallel(model, ["cuda:0", "cuda:1"], sharded=True)

The plan splits the big layers; norms, biases and small layers stay replicated, a full copy (with its
gradient and optimizer state) on every device. With `sharded`, device r keeps only rows
``[start_r, stop_r)`` (dim 0, split as evenly as `split_evenly` says) of each such parameter, as the
parameter itself, so `model.parameters()`, the gradients and the optimizer's state are 1/N per device.

At the start of every forward call each shard gathers all of its partitioned parameters in ONE all-gather
(counted by `tp.count_collectives` as ``all_gather`` at "zero-3") and the modules see full tensors until the
call returns (through comm/functions.py's `GatherRows`: each shard's own node when the shards own their graphs,
one node for all with one graph across devices). Backward needs no
communication: under the SPMD convention (comm/interface.py) every shard computes the full, identical gradient
of a replicated parameter, so the gather's backward keeps each shard's own rows. The optimizer updates rows elementwise, exactly as it would update the full copies, so
training matches the unsplit run bit for bit where the unsharded engine does.

Costs: one all-gather per forward call, and the gathered tensors stay alive while autograd needs them
(until backward), like the replicated copies they stand for. A block recomputed in backward (activation
checkpointing) runs outside the call: each module holding partitioned parameters gathers its own then.
Parameters with fewer rows than devices, buffers, and frozen parameters (by default) stay replicated.

Under torchrun the same job belongs to FSDP2 (`fully_shard`) on a data-parallel mesh axis: see
docs/checkpoints.md.
"""

from __future__ import annotations

import difflib
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ...comm import functions
from ...comm.thread_collectives import AllShards, OneShard
from ...logs import get_logger
from ...partition import Partition, split_evenly

logger = get_logger(__name__)

WHERE = "zero-3"


@dataclass(frozen=True)
class ZeroSharding:
    """What ZeRO-3 partitions on a split model (``model.sharding_manager``, the tensor_parallel package's name):
    the parameters, by the unsplit model's names, over `world_size` devices."""

    sharded_param_names: tuple[str, ...]
    world_size: int


def default_sharded(module: nn.Module, world_size: int) -> bool:
    """``sharded=None``: on when training (module in train mode with a trainable parameter) on 2+ devices.

    Inference (``model.eval()``, as transformers' from_pretrained returns models) keeps replicated
    parameters whole: no extra all-gather per generated token.
    """
    return world_size > 1 and module.training and any(p.requires_grad for p in module.parameters())


def zero_partition(rows: int, world_size: int) -> Partition:
    """Rows of a dim-0 ZeRO partition: 10 rows over 4 devices -> 3, 3, 2, 2."""
    ranges, start = [], 0
    for size in split_evenly(rows, world_size):
        ranges.append(((start, start + size),))
        start += size
    return Partition(rows, tuple(ranges))


def choose_params(module: nn.Module, splits: dict, world: int, names: Sequence[str] | None) -> list[str]:
    """Which parameter names ZeRO-3 partitions, validating user-given names.

    Called on the unsplit module with the plan's `splits` (name -> split or None) before anything is
    changed, so a bad name leaves the user's model as it was.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    if names is None:
        chosen = [
            n for n, p in params.items()
            if splits.get(n) is None and p.requires_grad and p.dim() >= 1 and p.shape[0] >= world
        ]
        skipped = [n for n, p in params.items() if splits.get(n) is None and n not in chosen]
        if skipped:
            logger.debug("ZeRO-3 leaves whole (frozen, scalar, or fewer rows than devices): %s", skipped)
        return chosen
    if isinstance(names, str):
        raise TypeError(f"sharded_param_names must be a list of parameter names; got the string {names!r}")
    chosen = []
    for name in names:
        if name in buffers:
            raise ValueError(f"sharded_param_names: {name!r} is a buffer; ZeRO-3 partitions parameters only")
        if name not in params:
            close = difflib.get_close_matches(name, list(params), n=3)
            hint = f" Closest: {', '.join(close)}." if close else ""
            raise ValueError(f"sharded_param_names: {name!r} is not a parameter of the model.{hint}")
        if splits.get(name) is not None:
            raise ValueError(
                f"sharded_param_names: {name!r} is already split by the plan (dim {splits[name][0]}); "
                "ZeRO-3 partitions only what the plan leaves whole"
            )
        p = params[name]
        if p.dim() == 0 or p.shape[0] < world:
            raise ValueError(
                f"sharded_param_names: {name!r} has shape {tuple(p.shape)}, fewer rows than the {world} devices; "
                "leave it out"
            )
        chosen.append(name)
    return chosen


def shard_replicated(model, chosen: Sequence[str]) -> list[str]:
    """Partition the replicated parameters `chosen` (see `choose_params`) of a TensorParallel model.

    Returns the names partitioned. Tied parameters stay tied (one slice object per device).
    """
    world = model.world_size
    if world == 1 or not chosen:
        return []
    if getattr(model, "zero_splits", None):
        raise RuntimeError("this model is already ZeRO-3 partitioned")
    state, tied = _partition(model, chosen)
    everything = list(range(len(state.partitions)))
    for rank, shard in enumerate(model.module_shards):
        state.hook(shard, rank, everything, WHERE, root=True)
    _hook_modules(model, state, everything)
    first = dict(model.module_shards[0].named_parameters(remove_duplicate=False))
    saved = sum(p.numel() for names_ in tied for p in [first[names_[0]]]) * (world - 1) // world
    logger.info(
        "ZeRO-3: %d replicated parameter(s) partitioned over %d devices (~%d elements fewer per device)",
        len(tied), world, saved,
    )
    return [n for names_ in tied for n in names_]


def shard_added(model, chosen: Sequence[str]) -> list[str]:
    """ZeRO-3 for parameters added to a split model after splitting (PEFT adapters adopted late), whatever
    `sharded` was: gathered in one more all-gather at the start of every forward call, before the hooks
    installed since splitting run (partial gradients read the gathered tensors). Returns the names partitioned."""
    if model.world_size == 1 or not chosen:
        return []
    known = len(model._zero.partitions) if getattr(model, "_zero", None) is not None else 0
    state, tied = _partition(model, chosen)
    added = list(range(known, len(state.partitions)))
    for rank, shard in enumerate(model.module_shards):
        state.hook(shard, rank, added, WHERE, first=True, root=True)
    _hook_modules(model, state, added)
    logger.info("ZeRO-3: %d parameter(s) added after splitting partitioned over %d devices", len(tied), model.world_size)
    return [n for names_ in tied for n in names_]


def _partition(model, chosen: Sequence[str]) -> tuple["_ZeroState", list[list[str]]]:
    """Partition the parameters `chosen` along dim 0 on every shard; their gathering state (the model's, extended)."""
    world = model.world_size
    # Group names by tensor (tied weights appear under several names, all of which get the slice).
    shards = list(model.module_shards)
    first = dict(shards[0].named_parameters(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    for name, p in first.items():
        if model.splits.get(name) is None:
            groups.setdefault(id(p), []).append(name)
    wanted = {id(first[n]) for n in chosen}
    tied = [names_ for key, names_ in groups.items() if key in wanted]

    zero_splits = {}
    slots: list[list[list[tuple[nn.Module, str]]]] = [[] for _ in range(world)]  # rank -> param -> owners
    partitions = []
    for names_ in tied:
        full = first[names_[0]]
        part = zero_partition(full.shape[0], world)
        partitions.append(part)
        for name in names_:
            zero_splits[name] = (0, part)
        for rank, shard in enumerate(shards):
            owners = [_owner(shard, n) for n in names_]
            old = owners[0][0]._parameters[owners[0][1]]
            (start, stop), = part.ranges[rank]
            # clone: the slice must not keep the full tensor's storage alive
            data = old.detach().narrow(0, start, stop - start)
            new = nn.Parameter(data if data.is_meta else data.clone(), requires_grad=old.requires_grad)
            for module, attr in owners:
                module._parameters[attr] = new
            slots[rank].append(owners)

    state = getattr(model, "_zero", None)
    if state is None:
        state = model._zero = _ZeroState(model, [[] for _ in range(world)], [])
    for rank in range(world):
        state.slots[rank].extend(slots[rank])
    state.partitions.extend(partitions)
    model.zero_splits = {**(getattr(model, "zero_splits", None) or {}), **zero_splits}
    return state, tied


def _hook_modules(model, state: "_ZeroState", indices: list[int]) -> None:
    """A block recomputed in backward (activation checkpointing) runs its modules outside the call of the whole
    shard: each module holding partitioned parameters then gathers its own."""
    if not model._group.own_graphs:
        return
    for rank, shard in enumerate(model.module_shards):
        for name, module in shard.named_modules():
            mine = [i for i in indices if any(m is module for m, _ in state.slots[rank][i])]
            if mine:
                state.hook(module, rank, mine, f"{WHERE} {name} (recomputed)")


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attr = name.rpartition(".")
    return (root.get_submodule(module_name) if module_name else root), attr


class _Flag:
    """A bool as an object's attribute: a hook's closure holds the object (see _ZeroState.whole)."""

    def __init__(self) -> None:
        self.value = False


class _ZeroState:
    """The hooks of every shard: gather partitioned parameters before a call, put the slices back after.

    A scope is a module and the partitioned parameters it gathers: the whole shard (all of them, once per
    forward call) or, for recomputation in backward, a module holding some (only when they are not gathered
    already)."""

    def __init__(self, model, slots, partitions: list[Partition]) -> None:
        self.group = model._group
        self._shards = [OneShard(self.group, rank) for rank in range(self.group.world_size)]
        self._all_shards = AllShards(self.group.devices)
        self.slots = slots
        self.partitions = partitions
        self.gathered: list[set[int]] = [set() for _ in slots]  # rank -> indices of the parameters gathered now
        self.saved: list[dict[object, list[nn.Parameter]]] = [{} for _ in slots]  # rank -> scope -> its slices
        self.viewed: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # modules views run, hooked (hook_view)
        self.outside = [False] * len(slots)  # rank -> gathered around a compiled forward (gather_everything)
        self.whole = [_Flag() for _ in slots]  # rank -> every partitioned parameter gathered now
        self.roots: "weakref.WeakSet[_Flag]" = weakref.WeakSet()  # the scopes of whole shards (`hook(root=True)`)

    # The hooks read flags held by their closures (is everything gathered on this shard? did this scope gather?)
    # before anything indexed by rank or by parameter: a block compiled per block (torchtitan's way) traces its
    # modules' hooks, and dynamo guards on what they read, so hooks that read only these flags (the same values
    # in every block and on every shard while the split model's call holds everything gathered) let one graph
    # serve every block and shard.
    def hook(self, module: nn.Module, rank: int, indices: list[int], where: str, *, first: bool = False, root: bool = False) -> None:
        """Gather `indices` around each call of `module` (`root`: the shard itself, once per forward call)."""
        scope, whole = _Flag(), self.whole[rank]  # a module may hold several scopes (split time, added later, a view's)
        if root:
            self.roots.add(scope)
            module.register_forward_pre_hook(lambda mod, args: self._root_scope(scope, rank, indices, where), prepend=first)
        else:
            module.register_forward_pre_hook(
                lambda mod, args: None if whole.value else self._gather_scope(scope, rank, indices, where), prepend=first)
        # Released after the call, or if it raised, at the shard's next call (`_root_scope`): an `always_call` hook
        # makes dynamo guard on its id, which differs per module (a graph per block compiled per block).
        module.register_forward_hook(
            lambda mod, args, out: self._release_scope(scope, rank) if scope.value else None, always_call=root)

    def _root_scope(self, scope: "_Flag", rank: int, indices: list[int], where: str) -> None:
        """A shard's forward call starts: what a module's call that raised left gathered is put back (a root scope is
        released even then), then `indices` gathered."""
        if not self.outside[rank]:
            for held in [s for s in self.saved[rank] if s not in self.roots]:
                self._release_scope(held, rank)
        self._gather_scope(scope, rank, indices, where)

    def hook_view(self, module: nn.Module, rank: int) -> None:
        """A module a view runs (views.py): its calls gather every partitioned parameter, those partitioned after
        the view was made included, first of its hooks. Once per module, however many views run it."""
        if module in self.viewed:
            return
        self.viewed.add(module)
        scope, whole = _Flag(), self.whole[rank]
        every = lambda: list(range(len(self.partitions)))  # noqa: E731
        module.register_forward_pre_hook(
            lambda mod, args: None if whole.value else self._gather_scope(scope, rank, every(), WHERE), prepend=True)
        module.register_forward_hook(
            lambda mod, args, out: self._release_scope(scope, rank) if scope.value else None, always_call=True)

    def gather_everything(self, rank: int) -> object:
        """Gather shard `rank`'s partitioned parameters now (a compiled forward is about to run: its hooks do
        nothing, engines/inprocess/compiled_shards.py); returns the scope to `release`."""
        scope = _Flag()
        self._gather_scope(scope, rank, list(range(len(self.partitions))), WHERE)
        self.outside[rank] = True
        return scope

    def release(self, scope: object, rank: int) -> None:
        self.outside[rank] = False
        self._release_scope(scope, rank)

    def _gather_scope(self, scope: "_Flag", rank: int, indices: list[int], where: str) -> None:
        if self.outside[rank]:
            return  # gathered around a compiled forward (gather_everything): nothing for its trace to do
        if not indices or self.gathered[rank].intersection(indices):
            return  # nothing partitioned yet, or gathered by an enclosing scope
        owners = [self.slots[rank][i] for i in indices]
        slices = [mod._parameters[attr] for (mod, attr), *_ in owners]
        partitions = [self.partitions[i] for i in indices]
        if self.group.own_graphs:  # this shard's own node: its forward meets the other shards
            fulls = functions.gather_rows(self._shards[rank], where, partitions, *slices)
        else:
            gather = lambda payloads: self._gather_all(payloads, partitions, where)  # noqa: E731
            fulls = self.group.exchange(rank, "all_gather", where, slices, gather)
        for param_owners, full in zip(owners, fulls):
            for mod, attr in param_owners:
                mod._parameters[attr] = full  # a non-leaf tensor for this call; backward reaches the slice
        self.saved[rank][scope] = (slices, indices)
        scope.value = True  # this scope holds gathered parameters
        self.gathered[rank].update(indices)
        self.whole[rank].value = len(self.gathered[rank]) == len(self.partitions)

    def _release_scope(self, scope: "_Flag", rank: int) -> None:
        if self.outside[rank]:
            return
        held = self.saved[rank].pop(scope, None)
        if held is None:
            return
        scope.value = False
        slices, indices = held
        for i, p in zip(indices, slices):
            for mod, attr in self.slots[rank][i]:
                mod._parameters[attr] = p
        self.gathered[rank].difference_update(indices)
        self.whole[rank].value = len(self.gathered[rank]) == len(self.partitions)

    def _gather_all(self, payloads: list[list[torch.Tensor]], partitions: list[Partition], where: str) -> list[list]:
        """Shards sharing one device: runs once per gather, in the last shard to arrive, as one node for all."""
        count, flat = len(partitions), [t for per_rank in payloads for t in per_rank]
        outs = functions.gather_rows(self._all_shards, where, partitions, *flat)
        return [outs[r * count:(r + 1) * count] for r in range(len(payloads))]
