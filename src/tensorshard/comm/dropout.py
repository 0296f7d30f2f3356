"""Dropout in training that keeps the shards consistent, in both engines.

A split model holds two kinds of activations. Replicated ones (the residual stream, a row-parallel layer's
reduced output) are bit-identical on every device, and the engine relies on it: each device computes the
full gradient of a replicated parameter (a norm's weight) and keeps its own copy. Split ones (attention
heads, an MLP's hidden slice) differ per device. Left to PyTorch, each shard draws its dropout masks from
its device's generator (CPU slots even share one, across threads, in no fixed order): replicated
activations then differ between devices, and so do the replicated parameters after an optimizer step.

Here every dropout of a training call draws from a generator of its own, seeded by a key:

    key = mix(call seed, n, rank if the input is split else -1)

The call seed is drawn once per call from torch's default generator (so `torch.manual_seed` makes a run
reproducible; under torchrun, TP rank 0's is used); n counts the dropouts of the call, in the same order
on every shard (they run the same code). Whether an input is split is decided by the shards together,
each time: they compare a fingerprint of their inputs (size and two sums), equal only for a replicated
activation, at the rendezvous (in one process) or in one small all-gather (under torchrun,
`DistPeers`). A replicated activation thus gets one mask on every device, the one an unsplit model using
the same keys would draw; a split one gets an independent mask per device.

Activation checkpointing recomputes a block in the backward pass and must draw the forward's masks
again: the forward records each dropout's key under the fingerprint of its input, which the
recomputation sees again bit for bit, and the shard's backward pass replays them from that record.
PyTorch's autograd engine runs the recomputation without the thread's function modes, so every module of
a shard carries a forward pre-hook that enters the mode when a module runs inside a backward pass (a
recomputed layer, as `gradient_checkpointing_enable()` and `checkpoint(module, ...)` recompute). In one
process the backward pass of a call replays that call's record; under torchrun, the records of the last
few calls are searched, newest first. A recomputed function that applies dropout outside any module call
is not seen: it would draw fresh masks.

What is intercepted (a `TorchFunctionMode` in each shard's thread, only for training calls of a model
that has some dropout): `F.dropout`, `F.dropout1d/2d/3d` and `torch.dropout` (so every `nn.Dropout`), and
`scaled_dot_product_attention` with `dropout_p > 0`, computed by its reference math with the mask above.
Alpha dropout is left to PyTorch.

Compiled (torch.compile of a model parallelized under torchrun, in training): the mode is entered inside the traced
call and dynamo traces it; each dropout becomes `tensorshard::dropout_mask`, an operator that draws the very mask
above when the graph runs (the same fingerprints, all-gather, keys and record), its call number fixed when traced,
after one `tensorshard::dropout_seed` that starts the call's record (its output feeds every mask: the graph cannot
run a mask first). So a compiled step draws the eager step's masks, equal on every rank for a replicated
activation, independent for a split one. A block recomputed in a compiled backward (activation checkpointing inside
the graph) would draw new keys: not supported there.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections import defaultdict, deque
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

_MASK = (1 << 63) - 1
_ELEMENTWISE = (F.dropout, torch.dropout)
_CHANNELWISE = {F.dropout1d: 1, F.dropout2d: 2, F.dropout3d: 3}
_SDPA = F.scaled_dot_product_attention


def may_drop(module: nn.Module) -> bool:
    """Whether a model may apply dropout in training: an nn.Dropout with p > 0, or a float attribute named
    like a dropout probability (transformers' attention and layer modules keep `dropout`, `attention_dropout`,
    `resid_pdrop`...) above 0. Models without are not intercepted at all."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            if m.p > 0:
                return True
            continue
        for name, value in vars(m).items():
            if isinstance(value, float) and value > 0 and ("dropout" in name or "pdrop" in name):
                return True
    return False


def _mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps): different keys give unrelated generator streams."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & _MASK


def _fingerprint(x: torch.Tensor) -> tuple:
    flat = x.detach().reshape(-1)
    sums = torch.stack([flat.sum(dtype=torch.float64), flat[1::3].sum(dtype=torch.float64)]).tolist()
    return (tuple(x.shape), str(x.dtype), *sums)


class DropoutRecord:
    """The keys one forward call used, per shard, under their inputs' fingerprints (for recomputation)."""

    def __init__(self, seed: int, world: int) -> None:
        self.seed = seed
        self.keys: list[dict[tuple, list[int]]] = [defaultdict(list) for _ in range(world)]


class ThreadPeers:
    """The shards of one process (the in-process engine), meeting at their rendezvous."""

    def __init__(self, group) -> None:
        self.group, self.world = group, group.world_size

    def rank(self, shard: int) -> int:
        return shard

    def agree(self, shard: int, n: int, fingerprint: tuple, seed: int) -> tuple[bool, int]:
        """(whether every shard's input has this fingerprint, the call's seed)."""
        same = self.group.exchange(
            shard, "dropout", f"dropout #{n + 1}", fingerprint, lambda prints: [all(p == prints[0] for p in prints)] * len(prints)
        )
        return same, seed

    def in_backward(self, shard: int) -> bool:
        return self.group.in_backward(shard)


class DistPeers:
    """This process's shard under torchrun: the fingerprints (and TP rank 0's seed) in one small all-gather."""

    world = 1

    def __init__(self, comm) -> None:
        self.comm = comm

    def rank(self, shard: int) -> int:
        return self.comm.rank

    def agree(self, shard: int, n: int, fingerprint: tuple, seed: int) -> tuple[bool, int]:
        mine = torch.tensor([float(seed), float(math.prod(fingerprint[0])), *fingerprint[2:]], dtype=torch.float64)
        rows = self.comm.gather_small(mine, where=f"dropout #{n + 1}")
        return all(torch.equal(r[1:], rows[0][1:]) for r in rows), int(rows[0][0])

    def in_backward(self, shard: int) -> bool:
        return torch._C._current_graph_task_id() != -1


class ShardDropout:
    """Consistent dropout for the shards of one split model that `peers` runs (see the module docstring);
    `peers=None`: one unsplit model drawing the same keyed masks (every activation counts as replicated)."""

    def __init__(self, peers: ThreadPeers | DistPeers | None = None, *, keep: int = 1) -> None:
        self.peers = peers
        self.world = peers.world if peers is not None else 1
        self.record: DropoutRecord | None = None  # the forward call being run
        self._recent: deque[DropoutRecord] = deque(maxlen=keep)  # what a backward pass may recompute
        self._count = [0] * self.world  # dropouts so far in this call, per shard
        self._replayed: list[dict[tuple, int]] = [{} for _ in range(self.world)]
        self._generators: dict[int, torch.Generator] = {}  # per shard: CPU slots share a device, not a generator
        self._active: list[tuple[nn.Module, _DropoutMode] | None] = [None] * self.world
        self.in_call = False  # the engine's eager wrapper began this call's record (see dropout_seed)
        self.handle = next(_handles)  # how compiled graphs name it (dropout_seed, dropout_mask below)
        _owners[self.handle] = self

    def begin_forward(self) -> DropoutRecord:
        """A new training call: its seed, drawn from torch's default generator (< 2**52: exact as a float)."""
        seed = int(torch.randint(0, 1 << 52, (), dtype=torch.int64))
        self.record = DropoutRecord(seed, self.world)
        self._recent.append(self.record)
        self._count = [0] * self.world
        self._replayed = [{} for _ in range(self.world)]
        return self.record

    def begin_backward(self, record: DropoutRecord) -> None:
        """The backward pass of the call that left `record` (in one process): its recomputations replay it."""
        self._recent.clear()
        self._recent.append(record)
        self._replayed = [{} for _ in range(self.world)]

    def mode(self, shard: int = 0) -> "_DropoutMode":
        return _DropoutMode(self, shard)

    def install(self, shards) -> None:
        """Hooks every module of every shard so a recomputation in backward runs under the mode."""
        for shard, root in enumerate(shards):
            for module in root.modules():
                module.register_forward_pre_hook(self._enter(shard))
                module.register_forward_hook(self._leave(shard), always_call=True)

    def _enter(self, shard: int):
        def hook(module, args):
            if torch.compiler.is_compiling():
                return  # a traced call enters the mode itself (module docstring)
            if self._active[shard] is None and self._recent and self.peers.in_backward(shard):
                mode = self.mode(shard)
                mode.__enter__()
                self._active[shard] = (module, mode)

        return hook

    def _leave(self, shard: int):
        def hook(module, args, output):
            active = self._active[shard]
            if active is not None and active[0] is module:
                self._active[shard] = None
                active[1].__exit__(None, None, None)

        return hook

    # -- one dropout ----------------------------------------------------------------------------------------

    def key(self, shard: int, x: torch.Tensor, n: int | None = None) -> int:
        """The key of this dropout of `x` (the call's `n`-th, else the next): a new one in forward, the recorded
        one when recomputed in backward."""
        fingerprint = _fingerprint(x)
        if self.peers is not None and self.peers.in_backward(shard):
            return self._replay(shard, fingerprint, x)
        record, n = self.record, self._count[shard] if n is None else n
        self._count[shard] = n + 1
        replicated = True
        if self.peers is not None:
            replicated, record.seed = self.peers.agree(shard, n, fingerprint, record.seed)
        key = _mix(record.seed, n, -1 if replicated else self.peers.rank(shard))
        record.keys[shard][fingerprint].append(key)
        return key

    def _replay(self, shard: int, fingerprint: tuple, x: torch.Tensor) -> int:
        keys = next((r.keys[shard][fingerprint] for r in reversed(self._recent) if r.keys[shard].get(fingerprint)), None)
        if not keys:
            raise RuntimeError(
                f"a dropout recomputed in a backward pass saw an input its forward pass did not (shape {tuple(x.shape)}):"
                " the recomputation is not deterministic, or its forward call is no longer recorded, so it cannot draw"
                " the forward's masks again. Train with dropout off (p=0) or without activation checkpointing here."
            )
        i = self._replayed[shard].get(fingerprint, 0)
        self._replayed[shard][fingerprint] = i + 1
        return keys[i % len(keys)]

    def keep_mask(self, shard: int, x: torch.Tensor, p: float, shape: tuple[int, ...], n: int | None = None) -> torch.Tensor:
        """1/(1-p) where kept, 0 where dropped: drawn from this dropout's own generator."""
        g = self._generators.get(shard)
        if g is None or g.device != x.device:
            g = self._generators[shard] = torch.Generator(device=x.device)
        g.manual_seed(self.key(shard, x, n))
        mask = torch.empty(shape, dtype=x.dtype, device=x.device)
        if p >= 1:
            return mask.zero_()
        return mask.bernoulli_(1 - p, generator=g).div_(1 - p)


class _DropoutMode(TorchFunctionMode):
    """Routes the dropouts of one shard's training call through `ShardDropout` (see the module docstring)."""

    def __init__(self, owner: ShardDropout, shard: int) -> None:
        super().__init__()
        self.owner, self.shard = owner, shard
        self.seed: torch.Tensor | None = None  # traced: the call's dropout_seed
        self.n = 0  # traced: dropouts so far in the call

    def _mask(self, x: torch.Tensor, p: float, shape: tuple[int, ...]) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            return self.owner.keep_mask(self.shard, x, p, shape)
        if self.seed is None:
            self.seed = torch.ops.tensorshard.dropout_seed(x.detach(), self.owner.handle)
        self.n += 1
        return torch.ops.tensorshard.dropout_mask(x.detach(), self.seed, self.owner.handle, self.n - 1, p, list(shape))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ELEMENTWISE or func in _CHANNELWISE:
            x, p, training, inplace = _dropout_args(func, args, kwargs)
            if training and p > 0 and isinstance(x, torch.Tensor) and x.is_floating_point():
                return self._drop(func, x, p, inplace)
        elif func is _SDPA and _sdpa_dropout(args, kwargs) > 0:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _drop(self, func, x: torch.Tensor, p: float, inplace: bool) -> torch.Tensor:
        dims = _CHANNELWISE.get(func)
        if dims is None:
            shape = tuple(x.shape)
        else:
            batched = x.dim() == dims + 2  # (N, C, *spatial); else unbatched (C, *spatial)
            lead = 2 if batched else 1
            shape = tuple(x.shape[:lead]) + (1,) * (x.dim() - lead)
        mask = self._mask(x, p, shape)
        return x.mul_(mask) if inplace else x * mask

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        """scaled_dot_product_attention by its reference definition, its dropout drawn as every other here."""
        length, source = query.size(-2), key.size(-2)
        scale = 1 / math.sqrt(query.size(-1)) if scale is None else scale
        if enable_gqa:
            key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
            value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
        scores = (query @ key.transpose(-2, -1)) * scale
        if is_causal:
            causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
        blind = torch.isneginf(scores).all(dim=-1, keepdim=True)  # a query row that may see no key (padding)
        weights = torch.softmax(scores.masked_fill(blind, 0.0), dim=-1).masked_fill(blind, 0.0)  # 0 there, as SDPA
        weights = weights * self._mask(weights, dropout_p, tuple(weights.shape))
        return weights @ value


def _dropout_args(func, args, kwargs) -> tuple[Any, float, bool, bool]:
    """(input, p, training, inplace) of a dropout call, whichever way its arguments were passed."""
    names = ("input", "p", "train", "inplace") if func is torch.dropout else ("input", "p", "training", "inplace")
    bound = dict(zip(names, args)) | kwargs
    if func is torch.dropout:
        return bound["input"], float(bound["p"]), bool(bound["train"]), False
    x = bound.get("input", bound.get("self"))
    return x, float(bound.get("p", 0.5)), bool(bound.get("training", True)), bool(bound.get("inplace", False))


def _sdpa_dropout(args, kwargs) -> float:
    if "dropout_p" in kwargs:
        return float(kwargs["dropout_p"])
    return float(args[4]) if len(args) > 4 else 0.0


# --- the compiled graph's operators (module docstring) -----------------------------------------------------------

_owners: "weakref.WeakValueDictionary[int, ShardDropout]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)


def _owner(handle: int) -> ShardDropout:
    owner = _owners.get(handle)
    if owner is None:
        raise RuntimeError(f"a compiled graph drew dropout masks for a model that no longer exists (handle {handle}); "
                           "compile the parallelized model again")
    return owner


@torch.library.custom_op("tensorshard::dropout_seed", mutates_args=())
def dropout_seed(x: torch.Tensor, handle: int) -> torch.Tensor:
    """Starts a training call's dropout record (its seed from torch's default generator, as in eager), unless the
    engine's eager wrapper around a compiled forward began it (`in_call`); the seed, which every dropout_mask of the
    call reads (`x`: the first dropout's input, for the device)."""
    owner = _owner(handle)
    record = owner.record if owner.in_call and owner.record is not None else owner.begin_forward()
    return torch.tensor(record.seed, dtype=torch.int64, device=x.device)


@dropout_seed.register_fake
def _(x, handle):
    return torch.empty((), dtype=torch.int64, device=x.device)


@torch.library.custom_op("tensorshard::dropout_mask", mutates_args=())
def dropout_mask(x: torch.Tensor, seed: torch.Tensor, handle: int, n: int, p: float, shape: list[int]) -> torch.Tensor:
    """The keep mask of the call's `n`-th dropout of `x` (ShardDropout.keep_mask); `seed` orders it after
    dropout_seed."""
    return _owner(handle).keep_mask(0, x, p, tuple(shape), n)


@dropout_mask.register_fake
def _(x, seed, handle, n, p, shape):
    return x.new_empty(shape)
