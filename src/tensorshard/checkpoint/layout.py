"""Where each tensor of the unsplit model lives in a split one: the geometry every checkpoint path shares.

A *placement* says which part of a global tensor each rank holds: ``None`` (the whole tensor, on every
rank) or ``(dim, Partition)`` (rank r holds the ranges ``partition.ranges[r]`` of dimension `dim`,
concatenated in that order). Placements come from the engine that split the model, as a `SplitLayout`
(plans/slices.py): the plan's splits, plus ZeRO-3's dim-0 partitions of the parameters the plan leaves whole.

Checkpoint files store *chunks*: boxes of the global tensor (``offsets``, ``sizes`` per dimension, as in
`torch.distributed.checkpoint`). Resharding is box arithmetic: a rank of the model being loaded needs the
boxes its placement names, and reads the part of every saved chunk that overlaps them. Nothing depends on
the device count the checkpoint was saved at, so any count loads any other, bit for bit.

`model_layout(model)` (describe.py) lists the tensors of a `TensorParallel`, of a module split by
`parallelize` under torchrun (torchrun.py), or of a plain module (one rank) once each, tied weights under
one canonical name with their aliases, with each rank's local tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Iterator

import torch
from torch import nn

from .. import quant
from ..plans.slices import Placement, split_layout


@dataclass(frozen=True)
class Box:
    """A block of a global tensor: `sizes[d]` indices from `offsets[d]` along every dimension d."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> "Box":
        return cls((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return prod(self.sizes)

    def intersect(self, other: "Box") -> "Box | None":
        offsets, sizes = [], []
        for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            start, stop = max(a, b), min(a + n, b + m)
            if stop <= start:
                return None
            offsets.append(start)
            sizes.append(stop - start)
        return Box(tuple(offsets), tuple(sizes))

    def within(self, outer: "Box") -> tuple[slice, ...]:
        """Index of this box inside a tensor that holds `outer` (this box must lie inside it)."""
        return tuple(slice(o - p, o - p + n) for o, n, p in zip(self.offsets, self.sizes, outer.offsets))


def rank_pieces(shape: tuple[int, ...], placement: Placement, rank: int) -> list[tuple[Box, int]]:
    """The boxes rank `rank` holds, each with its start along the split dim of the local tensor.

    (shape (96, 64), (0, ranges ((0, 32),) for rank 0)) -> [(Box((0, 0), (32, 64)), 0)]
    """
    if placement is None:
        return [(Box.whole(shape), 0)]
    dim, part = placement
    pieces, local = [], 0
    for start, stop in part.ranges[rank]:
        offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(stop - start if d == dim else n for d, n in enumerate(shape))
        pieces.append((Box(offsets, sizes), local))
        local += stop - start
    return pieces


def saved_pieces(shape: tuple[int, ...], placement: Placement, rank: int) -> list[tuple[Box, int]]:
    """The pieces rank `rank` writes: those no earlier rank holds, so every element is stored once.

    A replicated tensor is written by rank 0 only; a KV head replicated over two ranks by the first of them.
    """
    if placement is None:
        return rank_pieces(shape, None, 0) if rank == 0 else []
    dim, part = placement
    earlier = [rng for r in range(rank) for rng in part.ranges[r]]
    out = []
    for box, local in rank_pieces(shape, placement, rank):
        start, stop = box.offsets[dim], box.offsets[dim] + box.sizes[dim]
        for a, b in _subtract((start, stop), earlier):
            offsets = tuple(a if d == dim else o for d, o in enumerate(box.offsets))
            sizes = tuple(b - a if d == dim else n for d, n in enumerate(box.sizes))
            out.append((Box(offsets, sizes), local + a - start))
    return out


def _subtract(rng: tuple[int, int], others: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `rng` that none of `others` covers."""
    pieces = [rng]
    for a, b in others:
        pieces = [p for s, e in pieces for p in ((s, min(e, a)), (max(s, b), e)) if p[1] > p[0]]
    return pieces


def local_shape(shape: tuple[int, ...], placement: Placement, rank: int) -> tuple[int, ...]:
    if placement is None:
        return tuple(shape)
    dim, part = placement
    return tuple(part.local_size(rank) if d == dim else n for d, n in enumerate(shape))


def local_view(local: torch.Tensor, placement: Placement, box: Box, start: int) -> torch.Tensor:
    """The part of a rank's local tensor that holds `box` (from `rank_pieces`)."""
    if placement is None:
        return local
    dim = placement[0]
    return local.narrow(dim, start, box.sizes[dim])


# --- the tensors of a model -----------------------------------------------------------------------------


@dataclass
class TensorEntry:
    """One tensor of the unsplit model and where each rank keeps its part."""

    name: str  # canonical state-dict name (the first one, for tied weights)
    aliases: tuple[str, ...]  # other names of the same tensor
    kind: str  # "param" or "buffer"
    shape: tuple[int, ...]  # global shape
    dtype: torch.dtype
    placement: Placement
    persistent: bool  # appears in state_dict()
    requires_grad: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class ModelLayout:
    """The tensors of a (possibly split) model, each listed once, and how to reach every rank's copy.

    In one process every rank is here (`ranks` is all of them); under torchrun a process holds one rank
    (see torchrun.py, whose `TorchrunLayout` overrides the methods that touch tensors). Everything that
    reads or writes a model goes through these methods, so save and load code is the same for both.
    """

    world_size: int
    shards: list[nn.Module]  # one module tree per rank (the model itself for a plain module)
    entries: dict[str, TensorEntry]  # by canonical name, in state-dict order
    plan: object = None  # the Plan, for TensorParallel models
    zero: list[str] = field(default_factory=list)  # canonical names partitioned by ZeRO-3
    devices: list[torch.device] = field(default_factory=list)
    state_names: list[str] = field(default_factory=list)  # persistent names, in state-dict order
    engine: str = "inprocess"  # "inprocess", "plain" or "torchrun"
    writes: bool = True  # this process writes checkpoint files (not a data-parallel replica under torchrun)
    quantized: frozenset[str] = frozenset()  # names of bitsandbytes-quantized weights: never saved or loaded

    def refuse_quantized(self, *entries: TensorEntry) -> None:
        """Raise for a checkpoint that would read or write a quantized weight among `entries` (default: all of
        the model's), before anything is written (quant/__init__.py)."""
        for entry in entries or self.entries.values():
            hit = next((n for n in entry.names if n in self.quantized), None)
            if hit is not None:
                raise quant.checkpoint_error(hit)

    @property
    def ranks(self) -> list[int]:
        """The ranks whose tensors this process holds."""
        return list(range(self.world_size))

    @property
    def root(self) -> nn.Module:
        """A module tree with the original names (for messages)."""
        return self.shards[0]

    def local(self, entry: TensorEntry, rank: int) -> torch.Tensor:
        """Rank `rank`'s part of `entry`: a plain tensor of shape `local_shape(...)`; writing into it
        writes into the model."""
        return _find(self.shards[rank], entry.name)

    def param(self, entry: TensorEntry, rank: int) -> torch.Tensor:
        """The object an optimizer keys this rank's state by (the parameter itself)."""
        return _find(self.shards[rank], entry.name)

    def state_local(self, entry: TensorEntry, rank: int, value: torch.Tensor) -> torch.Tensor:
        """An optimizer state tensor of this rank's parameter, as a plain tensor shaped like `local`."""
        return value

    def new_local(self, entry: TensorEntry, rank: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh storage for rank `rank`'s part: (what `install`/`as_state` take, the tensor to fill)."""
        device = self.devices[rank] if self.devices[rank].type != "meta" else torch.device("cpu")
        t = torch.empty(local_shape(entry.shape, entry.placement, rank), dtype=dtype or entry.dtype, device=device)
        return t, t

    def as_state(self, entry: TensorEntry, rank: int, holder: torch.Tensor) -> torch.Tensor:
        """Storage from `new_local`, as the value an optimizer keeps for this rank's parameter."""
        return holder

    def install(self, entry: TensorEntry, rank: int, holder: torch.Tensor) -> torch.Tensor:
        """Put storage from `new_local` in place of rank `rank`'s tensor under every name of `entry`
        (ties stay tied)."""
        tensor = holder
        if entry.kind == "param" and not isinstance(holder, nn.Parameter):  # a converted one is kept as it is
            old = self.local(entry, rank)
            tensor = nn.Parameter(holder, requires_grad=old.requires_grad)
        for name in entry.names:
            owner, attr = _owner(self.shards[rank], name)
            (owner._parameters if entry.kind == "param" else owner._buffers)[attr] = tensor
        return tensor

    def gather(self, entry: TensorEntry, device: torch.device | str = "cpu") -> torch.Tensor:
        """The whole tensor of `entry`, assembled from every rank's part on `device` (a new tensor)."""
        self.refuse_quantized(entry)
        pieces = [self.local(entry, r).detach() for r in range(self.world_size)]
        if entry.placement is None:
            return pieces[0].to(device, copy=True)
        dim, partition = entry.placement
        return partition.assemble([p.to(device) for p in pieces], dim)

    def by_alias(self) -> dict[str, TensorEntry]:
        return {n: e for e in self.entries.values() for n in e.names}

    def __iter__(self) -> Iterator[TensorEntry]:
        return iter(self.entries.values())


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attr = name.rpartition(".")
    return (root.get_submodule(module_name) if module_name else root), attr


def _find(root: nn.Module, name: str) -> torch.Tensor:
    owner, attr = _owner(root, name)
    tensor = owner._parameters.get(attr)
    return owner._buffers[attr] if tensor is None else tensor


def placements(model: nn.Module) -> dict[str, Placement]:
    """Original name -> placement, ZeRO-3 partitions included (for a TensorParallel model)."""
    split = split_layout(model)
    if split is None or split.engine != "inprocess":
        raise TypeError(f"expected a TensorParallel model; got {type(model).__name__}")
    return split.placements


def is_split_model(model: object) -> bool:
    """True for a model split in one process (a TensorParallel)."""
    split = split_layout(model)
    return split is not None and split.engine == "inprocess"


def inprocess_layout(model: nn.Module) -> ModelLayout:
    """The layout of a TensorParallel model, or of a plain module (one rank, every tensor whole)."""
    split = split_layout(model)
    if split is not None:
        shards, where, zero, plan, devices, engine = split.shards, split.placements, split.zero, split.plan, split.devices, "inprocess"
    else:
        shards, where, zero, plan, engine = [model], None, [], None, "plain"
        devices = [next((t.device for t in list(model.parameters()) + list(model.buffers())), torch.device("cpu"))]
    entries = collect_entries(shards[0], lambda name, tensor: where.get(name) if where is not None else None)
    state_names = _state_dict_names(shards[0])
    return ModelLayout(
        len(shards), shards, entries, plan, zero, devices, state_names, engine, quantized=quant.quantized_names(shards[0])
    )


def _state_dict_names(root: nn.Module) -> list[str]:
    """The keys of the module class's own ``state_dict`` (not an instance override such as the one
    `save_tensor_parallel` installs under torchrun), in order."""
    return list(type(root).state_dict(root, keep_vars=True))


def collect_entries(root: nn.Module, placement_of, local_of=lambda tensor: tensor) -> dict[str, TensorEntry]:
    """Every parameter and buffer of `root` once (ties under their first name), with its global shape:
    the local shape with the split dim's full size. `placement_of(name, tensor)` gives its placement,
    `local_of(tensor)` the plain local tensor to read shapes and dtypes from."""
    persistent = set(_state_dict_names(root))
    entries: dict[str, TensorEntry] = {}
    seen: dict[int, TensorEntry] = {}
    for module_name, module in root.named_modules(remove_duplicate=False):
        for kind, store in (("param", module._parameters), ("buffer", module._buffers)):
            for attr, tensor in store.items():
                if tensor is None:
                    continue
                name = f"{module_name}.{attr}" if module_name else attr
                entry = seen.get(id(tensor))
                if entry is not None:
                    if name not in entry.names:
                        entry.aliases += (name,)
                    entry.persistent |= name in persistent
                    continue
                placement = placement_of(name, tensor)
                local = local_of(tensor)
                shape = list(local.shape)
                if placement is not None:
                    shape[placement[0]] = placement[1].size
                entry = TensorEntry(
                    name, (), kind, tuple(shape), local.dtype, placement, name in persistent,
                    requires_grad=bool(getattr(tensor, "requires_grad", False)),
                )
                seen[id(tensor)] = entry
                entries[name] = entry
    return entries
