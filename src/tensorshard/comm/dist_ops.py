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
    all_gather        backward: this rank's block of the gradient
    copy_to_parallel  forward: a copy (an op may not return its input)   backward: all_reduce

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

import torch

from ..partition import Partition
from .counter import record
from .dist_guard import guard_named
from .functions import all_gather_backward, all_reduce_backward, copy_to_parallel_backward
from .process_group import all_reduce_copy, label, nbytes as _nbytes
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
