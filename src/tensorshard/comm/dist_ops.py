"""The torchrun engine's collectives as torch ops, for the code that `torch.compile` traces.

    y = torch.ops.tensorshard.all_reduce(x, group_name, "layers.0.mlp.down_proj")   # a new tensor
    stacked = torch.ops.tensorshard.all_gather(piece, group_name, world, rank, "lm_head")

Dynamo cannot trace what a collective does on the host (a ProcessGroup is a TorchScript object it refuses;
the shared-memory transport polls FIFOs), and torch's functional collectives would take gloo's TCP path
instead of shared memory. So the compiled graph calls these opaque ops instead: each runs the very same
guarded collective as eager code (comm/transport.py: shared memory between CPU ranks of one host, else the
backend), counts it for `tp.count_collectives()` when it runs (not when it is traced), and has a fake
implementation (shapes only) and a backward that follows comm/interface.py's convention, by the rules the eager
autograd nodes use (comm/functions.py's `*_backward`, called here with this rank's one gradient):

    all_reduce        backward: identity
    all_reduce_max    no gradient (a vocabulary-parallel loss's stability shift)
    all_gather        backward: this rank's block of the gradient
    copy_to_parallel  forward: a copy (an op may not return its input)   backward: all_reduce
    split             forward: this rank's slice                          backward: gather (counted as eager's Split)
    tie               forward: a copy                                     backward: the sharers' sum (reduce_holders)
    reduce_scatter    forward: reduce-scatter (sequence)                  backward: all-gather (sequence)
    gather_sequence   forward: all-gather (sequence)                      backward: this rank's slice (no collective)
    claim_sequence    forward: a copy of a gathered sequence, for column layers
                                                                          backward: reduce-scatter of their partial sums
    defer_grad        forward: a copy of a parameter's local view         backward: hands the gradient to the bucket

Sequence parallelism in a graph: eager code decides a gather's backward when column layers claim its output
(comm/dist.py), after the gather ran; a traced op's backward is fixed when it is traced. So the traced gather's own
backward keeps this rank's slice (right for readers of a whole, replicated value), and column layers read its
output through `claim_sequence`, whose backward reduce-scatters their partial gradients into the gather's input:
one all-gather forward and one reduce-scatter backward, as in eager.

Partial gradients (norms on sequence shards) are summed as in eager, in the end-of-backward bucket
(comm/grad_bucket.py): `defer_grad`'s backward adds the gradient to the bucket when the compiled backward runs
and returns zeros for the local view (what reaches `.grad` through autograd), so the bucket's one all-reduce per
backward pass adds the same sums to the same `.grad` as in eager, with the same count.

A group is named by its `group_name` (a string dynamo can guard on); the guard registry of comm/dist_guard.py
finds the group. DistComm (comm/dist.py) switches to these ops while `torch.compiler.is_compiling()`.

Why these are not the in-process engine's operators (comm/thread_ops.py) with another handle: these carry autograd
(a compiled training step under torchrun), and name the group by `group_name`, the same for every DistComm of a
group. The in-process ones must not carry autograd: they are defined with torch.library's low-level API and no
autograd kernel, so that the ~20 calls per decoded token skip a Python autograd layer (an op with one costs a few
microseconds more per call, under no_grad too), and they name one shard's ThreadComm among the threads of one
process.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist

from ..partition import Partition
from .counter import record
from .dist_guard import guard_named
from .functions import all_gather_backward, all_reduce_backward, copy_to_parallel_backward
from .process_group import RankCollectives, all_reduce_copy, label, nbytes as _nbytes
from .thread_ops import groups_of, partition_of
from .transport import all_gather_


# --- all_reduce -----------------------------------------------------------------------------------------


# Inductor keeps these out of CUDA graphs (it partitions the graph around them, or leaves it uncaptured): a
# collective replayed from a graph would not wait on the host as the guard does, and NCCL's may hang on replay.
_NOT_IN_CUDA_GRAPHS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


@torch.library.custom_op("tensorshard::all_reduce", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def all_reduce(x: torch.Tensor, group_name: str, where: str, backward: bool = False) -> torch.Tensor:
    """The sum of every rank's `x` (a new tensor)."""
    out = all_reduce_copy(x, guard_named(group_name).group, what=label("all_reduce", where, backward))
    record("all_reduce", _nbytes(out), "backward" if backward else "forward", where)
    return out


@all_reduce.register_fake
def _(x, group_name, where, backward=False):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_backward(ctx, grad):
    (grad,) = all_reduce_backward((grad,))
    return grad, None, None, None


all_reduce.register_autograd(_all_reduce_backward)


@torch.library.custom_op("tensorshard::all_reduce_max", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def all_reduce_max(x: torch.Tensor, group_name: str, where: str) -> torch.Tensor:
    """The elementwise max over every rank (a new tensor; no gradient: a loss's stability shift)."""
    record("all_reduce", _nbytes(x), "forward", where)
    return all_reduce_copy(x, guard_named(group_name).group, dist.ReduceOp.MAX, what=label("all_reduce", where))


@all_reduce_max.register_fake
def _(x, group_name, where):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# --- all_gather -----------------------------------------------------------------------------------------


@torch.library.custom_op("tensorshard::all_gather", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def all_gather(piece: torch.Tensor, group_name: str, world: int, rank: int, where: str) -> torch.Tensor:
    """Every rank's `piece` (equal shapes), stacked on dim 0 in rank order: (world * piece.shape[0], ...)."""
    piece = piece.contiguous()
    out = piece.new_empty((world * piece.shape[0], *piece.shape[1:]))
    all_gather_(out, piece, guard_named(group_name).group, what=label("all_gather", where))
    record("all_gather", _nbytes(out), "forward", where)
    return out


@all_gather.register_fake
def _(piece, group_name, world, rank, where):
    return piece.new_empty((world * piece.shape[0], *piece.shape[1:]))


def _all_gather_setup(ctx, inputs, output):
    piece, _, world, rank, _ = inputs
    ctx.rank, ctx.stacked = rank, Partition.stacked(piece.shape[0], world)


def _all_gather_backward(ctx, grad):
    (grad,) = all_gather_backward((grad,), (ctx.rank,), ctx.stacked, 0)
    return grad, None, None, None, None


all_gather.register_autograd(_all_gather_backward, setup_context=_all_gather_setup)


# --- copy_to_parallel -------------------------------------------------------------------------------------


@torch.library.custom_op("tensorshard::copy_to_parallel", mutates_args=())
def copy_to_parallel(x: torch.Tensor, group_name: str, where: str) -> torch.Tensor:
    """`x` itself (as a copy) for split layers to read; its backward sums their partial gradients."""
    return x.clone()


@copy_to_parallel.register_fake
def _(x, group_name, where):
    return torch.empty_like(x)


def _copy_setup(ctx, inputs, output):
    ctx.group_name, ctx.where = inputs[1], inputs[2]


def _copy_backward(ctx, grad):
    (grad,) = copy_to_parallel_backward(
        (grad,), lambda gs: [torch.ops.tensorshard.all_reduce(g, ctx.group_name, ctx.where, True) for g in gs])
    return grad, None, None


copy_to_parallel.register_autograd(_copy_backward, setup_context=_copy_setup)


# --- the collectives of split inputs, replicated KV heads and sequence parallelism ---------------------------------
# Each runs `RankCollectives`' method (comm/process_group.py), the one eager code's autograd nodes call: the same
# transport, labels and counts. A partition travels as integers (thread_ops.layout_of), groups of ranks flattened.


def _raw(group_name: str, rank: int, world: int) -> RankCollectives:
    return RankCollectives(guard_named(group_name).group, rank, world)


@torch.library.custom_op("tensorshard::gather_partition", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def gather_partition(x: torch.Tensor, group_name: str, rank: int, world: int, dim: int, layout: list[int], op: str,
                     where: str, backward: bool) -> torch.Tensor:
    """The whole tensor along `dim`, each rank bringing its slice of the partition `layout` (no autograd: the
    backward of `split`)."""
    phase = "backward" if backward else "forward"
    return _raw(group_name, rank, world).gather([x.contiguous()], dim, partition_of(layout), op=op, where=where, phase=phase)[0]


@gather_partition.register_fake
def _(x, group_name, rank, world, dim, layout, op, where, backward):
    shape = list(x.shape)
    shape[dim] = layout[0]
    return x.new_empty(shape)


@torch.library.custom_op("tensorshard::split", mutates_args=())
def split(x: torch.Tensor, group_name: str, rank: int, world: int, dim: int, layout: list[int], where: str) -> torch.Tensor:
    """This rank's slice of a replicated `x` along `dim` (no communication); backward: the gradient gathered."""
    return partition_of(layout).take(x, dim, rank).clone(memory_format=torch.contiguous_format)


@split.register_fake
def _(x, group_name, rank, world, dim, layout, where):
    shape = list(x.shape)
    shape[dim] = partition_of(layout).local_size(rank)
    return x.new_empty(shape)


def _args_setup(ctx, inputs, output):
    """Keeps every argument after the tensor (split, tie, reduce_scatter and gather_sequence's backward read them)."""
    ctx.args = inputs[1:]


def _split_backward(ctx, grad):
    group_name, rank, world, dim, layout, where = ctx.args
    whole = torch.ops.tensorshard.gather_partition(grad, group_name, rank, world, dim, layout, "split", where, True)
    return whole, None, None, None, None, None, None


split.register_autograd(_split_backward, setup_context=_args_setup)


@torch.library.custom_op("tensorshard::reduce_holders", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def reduce_holders(grad: torch.Tensor, group_name: str, rank: int, world: int, groups: list[int], where: str) -> torch.Tensor:
    """The gradient of a slice held by several ranks (replicated KV heads), summed over its holders (tie's backward)."""
    out = _raw(group_name, rank, world).reduce_holders([grad], groups_of(groups), where=where)[0]
    return out.clone() if out is grad else out


@reduce_holders.register_fake
def _(grad, group_name, rank, world, groups, where):
    return torch.empty_like(grad)


@torch.library.custom_op("tensorshard::tie", mutates_args=())
def tie(x: torch.Tensor, group_name: str, rank: int, world: int, groups: list[int], where: str) -> torch.Tensor:
    """`x` (a copy); backward: the gradient summed over the ranks holding the same slice."""
    return x.clone()


@tie.register_fake
def _(x, group_name, rank, world, groups, where):
    return torch.empty_like(x)


def _tie_backward(ctx, grad):
    return torch.ops.tensorshard.reduce_holders(grad.contiguous(), *ctx.args), None, None, None, None, None


tie.register_autograd(_tie_backward, setup_context=_args_setup)


@torch.library.custom_op("tensorshard::gather_even", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def gather_even(x: torch.Tensor, group_name: str, rank: int, world: int, dim: int, where: str, backward: bool) -> torch.Tensor:
    """(.., T/N, ..) on each rank -> (.., T, ..), rank order (no autograd)."""
    return _raw(group_name, rank, world).gather_even([x], dim, where=where, phase="backward" if backward else "forward")[0]


def _sequence_whole(x: torch.Tensor, world: int, dim: int) -> torch.Tensor:
    """The shape (fake) of `world` sequence shards like `x` joined along `dim`."""
    shape = list(x.shape)
    shape[dim] *= world
    return x.new_empty(shape)


def _sequence_shard(x: torch.Tensor, world: int, dim: int) -> torch.Tensor:
    """The shape (fake) of one rank's sequence shard of `x` along `dim`."""
    shape = list(x.shape)
    shape[dim] //= world
    return x.new_empty(shape)


@gather_even.register_fake
def _(x, group_name, rank, world, dim, where, backward):
    return _sequence_whole(x, world, dim)


@torch.library.custom_op("tensorshard::reduce_scatter_even", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def reduce_scatter_even(x: torch.Tensor, group_name: str, rank: int, world: int, dim: int, where: str,
                        backward: bool) -> torch.Tensor:
    """(.., T, ..) partial sums on each rank -> this rank's (.., T/N, ..) slice of the total (no autograd)."""
    raw = _raw(group_name, rank, world)
    return raw.reduce_scatter_even([x], dim, where=where, phase="backward" if backward else "forward")[0]


@reduce_scatter_even.register_fake
def _(x, group_name, rank, world, dim, where, backward):
    return _sequence_shard(x, world, dim)


@torch.library.custom_op("tensorshard::reduce_scatter", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def reduce_scatter(x: torch.Tensor, group_name: str, rank: int, world: int, dim: int, where: str) -> torch.Tensor:
    """Partial sums -> this rank's sequence shard of the total; backward: the gradient's shards gathered."""
    return torch.ops.tensorshard.reduce_scatter_even(x, group_name, rank, world, dim, where, False)


@reduce_scatter.register_fake
def _(x, group_name, rank, world, dim, where):
    return _sequence_shard(x, world, dim)


def _reduce_scatter_backward(ctx, grad):
    return torch.ops.tensorshard.gather_even(grad.contiguous(), *ctx.args, True), None, None, None, None, None


reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_args_setup)


@torch.library.custom_op("tensorshard::gather_sequence", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def gather_sequence(x: torch.Tensor, group_name: str, rank: int, world: int, dim: int, where: str) -> torch.Tensor:
    """Sequence shards -> the whole sequence; backward: this rank's slice of the (whole) gradient."""
    return torch.ops.tensorshard.gather_even(x, group_name, rank, world, dim, where, False)


@gather_sequence.register_fake
def _(x, group_name, rank, world, dim, where):
    return _sequence_whole(x, world, dim)


def _gather_sequence_backward(ctx, grad):
    _, rank, world, dim, _ = ctx.args
    n = grad.shape[dim] // world
    return grad.narrow(dim, rank * n, n).contiguous(), None, None, None, None, None


gather_sequence.register_autograd(_gather_sequence_backward, setup_context=_args_setup)


@torch.library.custom_op("tensorshard::claim_sequence", mutates_args=())
def claim_sequence(gathered: torch.Tensor, shard: torch.Tensor, group_name: str, rank: int, world: int, dim: int,
                   where: str) -> torch.Tensor:
    """`gathered` (the output of gather_sequence of `shard`, as a copy), read by column layers: its gradient, their
    partial sums, is reduce-scattered into `shard`'s gradient."""
    return gathered.clone()


@claim_sequence.register_fake
def _(gathered, shard, group_name, rank, world, dim, where):
    return torch.empty_like(gathered)


def _claim_setup(ctx, inputs, output):
    ctx.args = inputs[2:]


def _claim_backward(ctx, grad):
    mine = torch.ops.tensorshard.reduce_scatter_even(grad.contiguous(), *ctx.args, True)
    return None, mine, None, None, None, None, None


claim_sequence.register_autograd(_claim_backward, setup_context=_claim_setup)


# --- partial gradients: the end-of-backward bucket, fed from the compiled backward ------------------------------

_deferred: dict[int, tuple] = {}  # slot -> (weak bucket, weak module, table name, parameter name)
_next_slot = itertools.count(1)


def deferred_slot(bucket, owner, table_name: str, name: str) -> int:
    """A number naming the parameter `owner.<table_name>[name]` and its bucket in traced graphs (set up when the
    engine wraps the module, not while tracing)."""
    slot = next(_next_slot)
    forget = lambda _, slot=slot: _deferred.pop(slot, None)  # noqa: E731 - the entry goes with its module
    _deferred[slot] = (weakref.ref(bucket), weakref.ref(owner, forget), table_name, name)
    return slot


@torch.library.custom_op("tensorshard::defer_grad", mutates_args=())
def defer_grad(local: torch.Tensor, slot: int, where: str) -> torch.Tensor:
    """`local` (a copy of a parameter's local view); backward: its gradient handed to the parameter's bucket."""
    return local.clone()


@defer_grad.register_fake
def _(local, slot, where):
    return torch.empty_like(local)


@torch.library.custom_op("tensorshard::defer_grad_backward", mutates_args=())
def defer_grad_backward(grad: torch.Tensor, slot: int, where: str) -> torch.Tensor:
    """Adds `grad` to the bucket of `slot`'s parameter (summed over the group at the end of the backward pass);
    returns zeros: what autograd adds to the parameter's `.grad` for this use."""
    entry = _deferred.get(slot)
    bucket, owner = (entry[0](), entry[1]()) if entry is not None else (None, None)
    if bucket is None or owner is None:
        raise RuntimeError(f"{where}: a compiled backward pass reached a parameter of a model that no longer exists "
                           f"(slot {slot}); compile the parallelized model again")
    bucket.add(getattr(owner, entry[2])[entry[3]], grad.clone())
    return torch.zeros_like(grad)


@defer_grad_backward.register_fake
def _(grad, slot, where):
    return torch.empty_like(grad)


def _defer_setup(ctx, inputs, output):
    ctx.slot, ctx.where = inputs[1], inputs[2]


def _defer_backward(ctx, grad):
    return torch.ops.tensorshard.defer_grad_backward(grad, ctx.slot, ctx.where), None, None


defer_grad.register_autograd(_defer_backward, setup_context=_defer_setup)

