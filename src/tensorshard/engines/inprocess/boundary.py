"""The in-process engine's boundary: the caller's inputs copied to every device, one output returned.

When the shards' graphs span the devices (comm/threads.py), inputs that need a gradient are copied
through `_ReplicateInput`, whose backward returns shard 0's gradient (every shard holds the same full
gradient of a replicated tensor), and outputs are taken from one shard through `_GatherOutput`, whose
backward hands the gradient to every shard. When every shard owns its graph, shard_backward.py makes
the copies leaves of the shards' graphs and joins the outputs instead. Either way, an output whose
shape differs between shards is an error: the plan left it split.

Objects that a call may modify (a KV cache) must not be shared by the shards: each kind registered with
`register_per_device` is turned into one object per device on the way in (each shard reaches its own) and
the shards' own objects are joined into one on the way out; lists and dicts are rebuilt for every shard;
iterators (generators), which every shard would advance, are refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.autograd import Function

from ...trees import flatten, unflatten


@dataclass(frozen=True)
class PerDevice:
    """How one kind of object passed to or returned from a call gets one instance per device."""

    accepts: Callable[[Any], bool]
    prepare: Callable[[Any, int], Any]  # (the caller's object, device count) -> the object every shard is given
    join: Callable[[list[Any]], Any]  # the shards' returned objects, in device order -> the caller's one


PER_DEVICE: list[PerDevice] = []


def register_per_device(kind: PerDevice) -> None:
    """Make the engine give every shard its own object of this kind (integrations/transformers: KV caches)."""
    if kind not in PER_DEVICE:
        PER_DEVICE.append(kind)


def _per_device(x: Any) -> PerDevice | None:
    return next((k for k in PER_DEVICE if k.accepts(x)), None)


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
        # a copy, not a view of the shard's tensor: the caller may modify it in place (Trainer's loss *= ...)
        return y.clone() if y.device == device else y.to(device)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, *(grad.to(d) for d in ctx.devices))


def to_device(tree: Any, device: torch.device) -> Any:
    leaves, spec = flatten(tree)
    if not any(isinstance(x, torch.Tensor) and x.device != device for x in leaves):
        return tree
    return unflatten([x.to(device) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def replicate_inputs(tree: Any, devices: list[torch.device], grad_copies: Callable[[torch.Tensor], list] | None = None):
    """A function rank -> that rank's copy of the inputs (tensors moved to its device).

    Inputs may live on any device: each shard gets its own copy on its device (they are not checked
    against the model's devices, as they would have to be under torchrun). `grad_copies(x)` makes the
    copies of an input that needs a gradient, one per device (default: through `_ReplicateInput`)."""
    leaves, spec = flatten(tree)
    meta = next((i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.is_meta), None)
    if meta is not None:
        raise ValueError(
            f"input tensor #{meta} (shape {tuple(leaves[meta].shape)}) is on the meta device: it has no values "
            "to compute with. Pass real tensors (on any device; each shard gets a copy on its own)."
        )
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            continue
        kind = _per_device(x)
        if kind is not None:
            leaves[i] = kind.prepare(x, len(devices))
        elif isinstance(x, Iterator):
            raise TypeError(
                f"input #{i} is an iterator ({type(x).__name__}): every shard of a split model would advance it. "
                "Pass a list (or tensor) instead."
            )
    grad = torch.is_grad_enabled()
    grad_copies = grad_copies or (lambda x: _ReplicateInput.apply(devices, x))
    copies = {
        i: grad_copies(x)
        for i, x in enumerate(leaves)
        if isinstance(x, torch.Tensor) and grad and x.requires_grad
    }

    def own(x: torch.Tensor, rank: int) -> torch.Tensor:
        # Every shard but the first gets its own copy even on the same device: a model that updates an input in
        # place (RWKV's recurrent state) must not have its shards race on one tensor, as on separate GPUs.
        moved = x.to(devices[rank], non_blocking=True)
        return moved.clone() if moved is x and rank > 0 else moved

    def for_rank(rank: int):
        local = [
            copies[i][rank] if i in copies else own(x, rank) if isinstance(x, torch.Tensor) else x
            for i, x in enumerate(leaves)
        ]
        return unflatten(local, spec)

    return for_rank


def output_leaves(outputs: list, src: int, labels, *, check_equal: bool) -> tuple[list, Callable[[list], Any]]:
    """Shard `src`'s output leaves, each as ``(leaf, per_rank)``: a tensor with its copy from every shard (checked
    to be replicated), or a non-tensor already joined (``per_rank`` None); and how to rebuild the output from them."""
    flats = [flatten(o) for o in outputs]
    leaves, spec = flats[src]
    items = []
    for i, leaf in enumerate(leaves):
        per_rank = [flat[0][i] for flat in flats]
        if not isinstance(leaf, torch.Tensor):
            items.append((join_object(leaf, per_rank), None))
            continue
        check_replicated(i, leaf, per_rank, src, labels, check_equal=check_equal)
        items.append((leaf, per_rank))
    return items, rebuilder(outputs[src], leaves, spec)


def gather_outputs(outputs: list, src: int, device: torch.device, devices, labels, *, check_equal: bool) -> Any:
    items, rebuild = output_leaves(outputs, src, labels, check_equal=check_equal)
    result = []
    for leaf, per_rank in items:
        if per_rank is None:
            result.append(leaf)
        elif torch.is_grad_enabled() and any(t.requires_grad for t in per_rank):
            result.append(_GatherOutput.apply(src, device, devices, *per_rank))
        else:
            result.append(leaf if leaf.device == device else leaf.to(device))
    return rebuild(result)


def rebuilder(output: Any, leaves: list, spec: Any) -> Callable[[list], Any]:
    """A function `rebuild(new_leaves)`: the shard's output tree `output` (flattened as `leaves`, `spec`) holding
    `new_leaves` instead. (A closure, not an object: torch.compile traces a split model's call through it.)"""

    def rebuild(new_leaves: list) -> Any:
        # Every leaf the one the shard's output holds (a decoding step's logits, on the output device, and the cache
        # every shard was given): that output object itself, without building a copy of it (a transformers
        # ModelOutput costs tens of microseconds to make).
        if all(a is b for a, b in zip(new_leaves, leaves)):
            return output
        return unflatten(new_leaves, spec)

    return rebuild


def join_object(leaf: Any, per_rank: list) -> Any:
    """A non-tensor output: the shards' per-device objects joined into one, or `leaf` (the output shard's) as it is."""
    kind = _per_device(leaf)
    return kind.join(per_rank) if kind is not None else leaf


def check_replicated(i: int, leaf: torch.Tensor, per_rank: list, src: int, labels, *, check_equal: bool) -> None:
    """Output leaf `i` must have one shape on every shard (and, in debug mode, one value)."""
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
