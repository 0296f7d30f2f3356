"""Collectives on a torch.distributed process group: the `Comm` of the torchrun engine.

One process per device runs one shard; shards meet in the collectives of the tensor-parallel group (one
dimension of a DeviceMesh). Every collective is an autograd Function that follows the SPMD convention of
comm/interface.py, so a backward pass issues exactly the collectives the convention implies, in the same order
on every rank (every rank runs the same graph):

    all_reduce        forward: all-reduce             backward: nothing
    copy_to_parallel  forward: nothing                backward: all-reduce
    all_gather        forward: all-gather (padded)    backward: nothing (own slice)
    split             forward: nothing (own slice)    backward: all-gather
    tie               forward: nothing                backward: one all-reduce, each sharer group's sum
    reduce_scatter    forward: reduce-scatter         backward: all-gather
    gather_sequence   forward: all-gather             backward: reduce-scatter (or own slice, see below)

Per-call state: `copy_to_parallel` runs once per input tensor per call of the root module, so q, k and v
reading the same tensor share one backward all-reduce. The engine brackets root calls with `begin_call` /
`end_call`; a submodule called on its own caches nothing (more backward all-reduces, still exact). When
column layers read the output of `gather_sequence`, `copy_to_parallel` claims it instead: no node of its
own, and the gather's backward becomes a reduce-scatter of their partial gradients (read by anything
else, its gradient is whole and the backward just keeps this rank's slice).

Parameters whose gradients are partial sums (`partial_grads`: norms running on sequence shards) go
through `PartialGradBucket`: one all-reduce per backward pass for all of them.

Every wait is bounded and failure-aware: each collective goes through its group's guard (comm/dist_guard.py),
labelled with the operation and the module ("all_reduce at layers.0.mlp.down_proj (backward)"), which is
what an error names when a rank dies, raises or does not arrive.

The data travels through comm/transport.py: shared memory between the CPU processes of one host, else the
process group's backend. All-gathers take equal sizes: uneven pieces (59/59/58 features, 5/4 heads) are
padded to the longest and trimmed after. Every collective is reported to `comm/counter.record` once.
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.autograd import Function, Variable
from torch.distributed.tensor import DTensor

from ..partition import Partition
from . import dist_ops
from .interface import Comm
from .counter import record
from .dist_guard import collective, guard_for
from .dtensor import as_dtensor, mesh_device
from .transport import all_gather_, all_gather_single, all_reduce_, connect, reduce_scatter_

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def label(op: str, where: str = "", backward: bool = False) -> str:
    """How errors name a collective: 'all_reduce at w2 (backward)'."""
    return (f"{op} at {where}" if where else op) + (" (backward)" if backward else "")


# --- raw collectives (no autograd) --------------------------------------------------------------------


def all_reduce_copy(x: torch.Tensor, group, op=dist.ReduceOp.SUM, *, what: str = "all_reduce") -> torch.Tensor:
    """A new tensor holding the reduction of `x` over `group` (x itself is left alone)."""
    out = x.detach().clone(memory_format=torch.contiguous_format)
    all_reduce_(out, group, op, what=what)
    return out


def gather_pieces(x: torch.Tensor, dim: int, sizes: list[int], group, *, what: str = "all_gather") -> list[torch.Tensor]:
    """Every rank's piece along `dim`; rank r's piece has sizes[r] entries (padded on the wire)."""
    longest = max(sizes)
    piece = x.detach()
    if piece.shape[dim] < longest:
        pad = list(piece.shape)
        pad[dim] = longest - piece.shape[dim]
        piece = torch.cat([piece, piece.new_zeros(pad)], dim)
    # Each rank's whole piece is one block of the output (no transposition of `dim` to the front, which
    # costs two strided copies of the full tensor when gathering logits along the vocabulary).
    piece = piece.contiguous()
    out = piece.new_empty((len(sizes) * piece.shape[0], *piece.shape[1:]))  # world pieces stacked on dim 0
    all_gather_(out, piece, group, what=what)
    blocks = out.view(len(sizes), *piece.shape)
    return [blocks[r].narrow(dim, 0, n) for r, n in enumerate(sizes)]


def gather_partition(x: torch.Tensor, dim: int, partition: Partition, group, *, what: str = "all_gather") -> torch.Tensor:
    """All-gather of a tensor split by `partition`: the whole tensor, on every rank."""
    sizes = [partition.local_size(r) for r in range(partition.world_size)]
    return partition.assemble(gather_pieces(x, dim, sizes, group, what=what), dim)


def _even(x: torch.Tensor, dim: int, world: int, where: str) -> None:
    if x.shape[dim] % world:
        raise ValueError(
            f"{where or 'sequence parallelism'}: dimension {dim} of a {tuple(x.shape)} activation has length "
            f"{x.shape[dim]}, which does not split evenly over {world} devices. Sequence parallelism needs the "
            f"sequence length to be a multiple of the tensor-parallel size: pad the batch to a multiple of {world}."
        )


def gather_even(x: torch.Tensor, dim: int, world: int, group, *, what: str = "all_gather") -> torch.Tensor:
    """(.., T/N, ..) on each rank -> (.., T, ..), rank order."""
    front = x.detach().movedim(dim, 0).contiguous()
    out = front.new_empty((world * front.shape[0], *front.shape[1:]))
    all_gather_(out, front, group, what=what)
    return out.movedim(0, dim).contiguous()


def reduce_scatter_even(x: torch.Tensor, dim: int, world: int, group, *, what: str = "reduce_scatter") -> torch.Tensor:
    """(.., T, ..) partial sums on each rank -> this rank's (.., T/N, ..) slice of the total."""
    front = x.detach().movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    reduce_scatter_(out, front, group, what=what)
    return out.movedim(0, dim).contiguous()


# --- autograd Functions -------------------------------------------------------------------------------


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, x, group, where):
        record("all_reduce", _nbytes(x), "forward", where)
        return all_reduce_copy(x, group, what=label("all_reduce", where))

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None  # dL/dy is replicated: every partial input gets it unchanged


def all_reduce(x: torch.Tensor, group, *, where: str = "") -> torch.Tensor:
    """Sum partial values over `group`: differentiable (backward: identity), counted."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _AllReduce.apply(x, group, where)
    record("all_reduce", _nbytes(x), "forward", where)
    return all_reduce_copy(x, group, what=label("all_reduce", where))


class _CopyToParallel(Function):
    @staticmethod
    def forward(ctx, x, group, where):
        ctx.group, ctx.where = group, where
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        record("all_reduce", _nbytes(grad), "backward", ctx.where)
        return all_reduce_copy(grad, ctx.group, what=label("all_reduce", ctx.where, backward=True)), None, None


class _AllGather(Function):
    @staticmethod
    def forward(ctx, x, comm, where, dim, partition):
        ctx.rank, ctx.dim, ctx.partition = comm.rank, dim, partition
        full = gather_partition(x, dim, partition, comm.group, what=label("all_gather", where))
        record("all_gather", _nbytes(full), "forward", where)
        return full

    @staticmethod
    def backward(ctx, grad):
        return ctx.partition.take(grad, ctx.dim, ctx.rank).contiguous(), None, None, None, None


class _Split(Function):
    @staticmethod
    def forward(ctx, x, comm, where, dim, partition):
        ctx.group, ctx.where, ctx.dim, ctx.partition = comm.group, where, dim, partition
        return partition.take(x, dim, comm.rank).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        full = gather_partition(grad, ctx.dim, ctx.partition, ctx.group, what=label("all_gather", ctx.where, backward=True))
        record("all_gather", _nbytes(full), "backward", ctx.where)
        return full, None, None, None, None


class _Tie(Function):
    """Sharers of a replicated KV head add their gradients. One all-reduce over the whole group of a
    (sharer groups, *shape) buffer: each rank writes its gradient into its group's row (no sub-groups to
    create, so every rank of every data-parallel replica makes the same calls)."""

    @staticmethod
    def forward(ctx, x, group, where, slot, n_slots):
        ctx.group, ctx.where, ctx.slot, ctx.n_slots = group, where, slot, n_slots
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        buf = grad.new_zeros((ctx.n_slots, *grad.shape))
        if ctx.slot is not None:
            buf[ctx.slot] = grad
        all_reduce_(buf, ctx.group, what=label("all_reduce", ctx.where, backward=True))
        record("all_reduce", _nbytes(buf), "backward", ctx.where)
        return (grad if ctx.slot is None else buf[ctx.slot]), None, None, None, None


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, x, comm, where, dim):
        ctx.comm, ctx.where, ctx.dim = comm, where, dim
        out = reduce_scatter_even(x, dim, comm.world_size, comm.group, what=label("reduce_scatter", where))
        record("reduce_scatter", _nbytes(out), "forward", where)
        return out

    @staticmethod
    def backward(ctx, grad):
        full = gather_even(grad, ctx.dim, ctx.comm.world_size, ctx.comm.group, what=label("all_gather", ctx.where, backward=True))
        record("all_gather", _nbytes(full), "backward", ctx.where)
        return full, None, None, None


@dataclass
class _Gathered:
    """Backward mode of one gather_sequence output: `partial` once column-parallel layers claimed it."""

    partial: bool = False


class _GatherSequence(Function):
    @staticmethod
    def forward(ctx, x, comm, where, dim, state):
        ctx.comm, ctx.where, ctx.dim, ctx.state = comm, where, dim, state
        full = gather_even(x, dim, comm.world_size, comm.group, what=label("all_gather", where))
        record("all_gather", _nbytes(full), "forward", where)
        return full

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        if ctx.state.partial:
            # Read by column-parallel layers: each rank holds part of dL/dy; sum it and keep our slice.
            out = reduce_scatter_even(grad, ctx.dim, comm.world_size, comm.group, what=label("reduce_scatter", ctx.where, backward=True))
            record("reduce_scatter", _nbytes(out), "backward", ctx.where)
            return out, None, None, None, None
        n = grad.shape[ctx.dim] // comm.world_size  # read as a replicated value: dL/dy is whole already
        return grad.narrow(ctx.dim, comm.rank * n, n).contiguous(), None, None, None, None


class _DeferGrad(Function):
    """Identity whose backward hands the gradient to a bucket instead of the parameter."""

    @staticmethod
    def forward(ctx, local, bucket, param):
        ctx.bucket, ctx.param = bucket, param
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        ctx.bucket.add(ctx.param, grad)
        return None, None, None


class PartialGradBucket:
    """Partial gradients of replicated parameters (modules running on sequence shards), reduced in one
    all-reduce per dtype at the end of each backward pass and then added to the parameters' `.grad`.

    Reducing each pass's own contribution (not `.grad`) keeps gradient accumulation exact."""

    def __init__(self, group) -> None:
        self.group = group
        self.pending: dict[int, tuple[Any, torch.Tensor]] = {}
        self.queued = False

    def add(self, param, grad: torch.Tensor) -> None:
        if not self.queued:
            Variable._execution_engine.queue_callback(self.flush)
            self.queued = True
        seen = self.pending.get(id(param))
        self.pending[id(param)] = (param, grad if seen is None else seen[1] + grad)

    def flush(self) -> None:
        items, self.pending, self.queued = list(self.pending.values()), {}, False
        by_dtype: dict[torch.dtype, list] = defaultdict(list)
        for param, grad in items:
            by_dtype[grad.dtype].append((param, grad))
        with torch.no_grad():
            for entries in by_dtype.values():
                flat = torch.cat([g.reshape(-1) for _, g in entries])
                where = f"partial gradients ({len(entries)} tensors)"
                all_reduce_(flat, self.group, what=label("all_reduce", where, backward=True))
                record("all_reduce", _nbytes(flat), "backward", where)
                offset = 0
                for param, grad in entries:
                    _accumulate(param, flat[offset : offset + grad.numel()].view_as(grad))
                    offset += grad.numel()


def _accumulate(param, grad: torch.Tensor) -> None:
    if param.grad is None:
        local = grad.clone()
        param.grad = DTensor.from_local(local, param.device_mesh, param.placements) if isinstance(param, DTensor) else local
    else:
        target = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        target.add_(grad)


# --- the Comm -----------------------------------------------------------------------------------------


def _alias_key(x: torch.Tensor) -> tuple:
    """Equal for `x` and its aliases: module hooks (full backward hooks, CommDebugMode's tracker) hand each
    submodule a fresh tensor object viewing the same data. The version counter (shared by aliases, bumped
    by in-place writes) keeps a modified tensor from matching its old self."""
    return (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x.device, x._version)


class DistComm(Comm):
    """Collectives of this process's shard, over the process group of a 1-D tensor-parallel mesh.

    `timeout` (seconds; None: TENSORSHARD_TIMEOUT, else 300) bounds every collective on the group."""

    def __init__(self, mesh: "DeviceMesh", timeout: float | None = None) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()
        self.group_name = self.group.group_name  # how traced code names it (comm/dist_ops.py)
        self.rank = mesh.get_local_rank()
        self.world_size = mesh.size()
        self.guard = guard_for(self.group)
        self.guard.set_timeout(timeout)
        if self.world_size > 1:
            connect(self.guard, mesh.device_type)  # shared memory between CPU ranks of one host
        self.bucket = PartialGradBucket(self.group)
        self.partial: set[tuple[int, str]] = set()  # (id(module), name) of parameters with partial grads
        self._depth = 0
        # this call's tensors by _alias_key (the tensors are kept so their memory is not reused meanwhile)
        self._parallel: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._gathered: dict[tuple, tuple[torch.Tensor, _Gathered]] = {}
        self._left_split: set[str] = set()  # all_gather sites that return the local slice (leave_split)

    # -- per-call state ----------------------------------------------------------------------------------

    def begin_call(self) -> None:
        if self._depth == 0:
            self._parallel, self._gathered = {}, {}
        self._depth += 1

    def end_call(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._parallel, self._gathered = {}, {}  # release the call's tensors

    # -- the collectives -----------------------------------------------------------------------------------

    # While torch.compile traces (torch.compiler.is_compiling()), every collective is one of comm/dist_ops.py's
    # ops: the graph holds the call, and the per-call bookkeeping below (Python dicts keyed by storage
    # addresses) is skipped: a traced column layer reduces its own input gradient, still exact.

    def all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        if torch.compiler.is_compiling():
            return dist_ops.all_reduce(x, self.group_name, where)
        return all_reduce(x, self.group, where=where)

    def copy_to_parallel(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1 or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        if torch.compiler.is_compiling():
            return dist_ops.copy_to_parallel(x, self.group_name, where)
        key = _alias_key(x)
        if self._depth:
            hit = self._parallel.get(key)
            if hit is not None:
                return hit[1]  # q, k and v (gate and up) share one node: backward reduces once
            source = self._gathered.get(key) or (self._gathered.get(_alias_key(x._base)) if x._base is not None else None)
            if source is not None:
                # A gathered sequence (or a view of it, x[:, -k:]) read by column layers: the gather's
                # backward reduce-scatters their partial gradients instead.
                source[1].partial = True
                self._parallel[key] = (x, x)
                return x
        y = _CopyToParallel.apply(x, self.group, where)
        if self._depth:
            self._parallel[key] = (x, y)
        return y

    def all_gather(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1 or where in self._left_split:
            return x
        if torch.compiler.is_compiling():
            return self._traced_gather(x, dim, partition, where)
        if torch.is_grad_enabled() and x.requires_grad:
            return _AllGather.apply(x, self, where, dim, partition)
        full = gather_partition(x, dim, partition, self.group, what=label("all_gather", where))
        record("all_gather", _nbytes(full), "forward", where)
        return full

    def _traced_gather(self, x: torch.Tensor, dim: int, partition: Partition, where: str) -> torch.Tensor:
        """`all_gather` as comm/dist_ops.py's op: each rank's piece padded to the longest, as gather_pieces does."""
        sizes = [partition.local_size(r) for r in range(self.world_size)]
        longest = max(sizes)
        piece = x.movedim(dim, 0)
        if piece.shape[0] < longest:
            piece = torch.cat([piece, piece.new_zeros((longest - piece.shape[0], *piece.shape[1:]))])
        stacked = dist_ops.all_gather(piece, self.group_name, self.world_size, self.rank, where)  # (world * longest, ..)
        pieces = [stacked.narrow(0, r * longest, n).movedim(0, dim) for r, n in enumerate(sizes)]
        return partition.assemble(pieces, dim)

    def gather_small(self, x: torch.Tensor, *, where: str = "") -> list[torch.Tensor]:
        """Every rank's copy of a small 1-D tensor (no autograd), in rank order: for agreeing on metadata."""
        if self.world_size == 1:
            return [x]
        local = x.to(mesh_device(self.mesh))
        rows = gather_even(local.reshape(1, -1), 0, self.world_size, self.group, what=label("all_gather", where))
        record("all_gather", _nbytes(rows), "forward", where)
        return list(rows.cpu())

    @contextmanager
    def leave_split(self, where: str):
        """While inside, the all-gather of the module named `where` (a column layer's gather_output) hands back
        this rank's slice: for a caller that computes from slices (integrations/causal_lm_loss.py)."""
        self._left_split.add(where)
        try:
            yield
        finally:
            self._left_split.discard(where)

    def split(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        if not (torch.is_grad_enabled() and x.requires_grad):
            return partition.take(x, dim, self.rank)  # no communication without a backward pass
        _refuse_traced("split", where)
        return _Split.apply(x, self, where, dim, partition)

    def tie(self, x: torch.Tensor, groups: list[list[int]], *, where: str = "") -> torch.Tensor:
        if self.world_size == 1 or not groups or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        slot = next((i for i, ranks in enumerate(groups) if self.rank in ranks), None)
        _refuse_traced("tie", where)
        return _Tie.apply(x, self.group, where, slot, len(groups))

    # -- sequence parallelism --------------------------------------------------------------------------------

    def reduce_scatter(self, x: torch.Tensor, dim: int, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        _refuse_traced("reduce_scatter", where)
        dim = dim % x.dim()
        _even(x, dim, self.world_size, where)
        if torch.is_grad_enabled() and x.requires_grad:
            return _ReduceScatter.apply(x, self, where, dim)
        out = reduce_scatter_even(x, dim, self.world_size, self.group, what=label("reduce_scatter", where))
        record("reduce_scatter", _nbytes(out), "forward", where)
        return out

    def gather_sequence(self, x: torch.Tensor, dim: int, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        _refuse_traced("gather_sequence", where)
        dim = dim % x.dim()
        if not (torch.is_grad_enabled() and x.requires_grad):
            full = gather_even(x, dim, self.world_size, self.group, what=label("all_gather", where))
            record("all_gather", _nbytes(full), "forward", where)
            return full
        state = _Gathered()
        y = _GatherSequence.apply(x, self, where, dim, state)
        if self._depth:
            self._gathered[_alias_key(y)] = (y, state)
        return y

    def partial_grads(self, module, names, *, where: str = "") -> None:
        self.partial.update((id(module), name) for name in names)

    def defer_grad(self, local: torch.Tensor, param, *, on_the_spot: bool = False, where: str = "") -> torch.Tensor:
        """The local view of a parameter whose gradient is a partial sum over the group: summed in the
        end-of-backward bucket, or with `on_the_spot` (FSDP2, which reads a module's gradients right after
        its backward) by its own all-reduce during backward."""
        if self.world_size == 1 or not (torch.is_grad_enabled() and local.requires_grad):
            return local
        _refuse_traced("partial gradients", where)
        if on_the_spot:
            return _CopyToParallel.apply(local, self.group, where)  # unbucketed: all-reduced on the spot
        return _DeferGrad.apply(local, self.bucket, param)

    # -- loss parallelism ------------------------------------------------------------------------------------

    def as_sharded(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = ""):
        return as_dtensor(x, dim % x.dim(), partition, self.mesh, where=where)


def _refuse_traced(kind: str, where: str) -> None:
    """Collectives that comm/dist_ops.py does not provide (here: with autograd on) refuse to be traced."""
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            f"{where or 'a module'}: the {kind} collective cannot be compiled yet (torch.compile of a parallelized "
            "model covers all_reduce, all_gather and copy_to_parallel, and split/tie without autograd). Compile "
            "under torch.no_grad() with a plan without sequence parallelism, or run this model without torch.compile"
        )


# --- Python objects (setup and checks, not the hot path) ----------------------------------------------


def _object_device(group) -> torch.device:
    getter = getattr(dist.distributed_c10d, "_get_object_coll_device", None)  # cuda for NCCL groups
    return torch.device(getter(group) if getter is not None else "cpu")


def gather_objects(obj: Any, group, *, what: str) -> list[Any]:
    """Every rank's `obj`, in group rank order: all_gather_object as two guarded all-gathers."""
    device = _object_device(group)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    sizes = torch.empty(world, dtype=torch.int64, device=device)
    collective(all_gather_single, sizes, sizes, torch.tensor([data.numel()], device=device), group=group, what=what)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    out = torch.empty(world * longest, dtype=torch.uint8, device=device)
    collective(all_gather_single, out, out, padded, group=group, what=what)
    out = out.cpu()
    return [pickle.loads(out[r * longest : r * longest + int(n)].numpy().tobytes()) for r, n in enumerate(sizes.tolist())]


def broadcast_object(obj: Any, src: int, group, *, what: str) -> Any:
    """Global rank `src`'s `obj` on every rank of `group`: broadcast_object_list as two guarded broadcasts."""
    device = _object_device(group)
    mine = dist.get_rank() == src
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device) if mine else None
    size = torch.tensor([data.numel() if mine else 0], dtype=torch.int64, device=device)
    collective(dist.broadcast, size, size, src=src, group=group, what=what)
    if not mine:
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
    collective(dist.broadcast, data, data, src=src, group=group, what=what)
    return obj if mine else pickle.loads(data.cpu().numpy().tobytes())
