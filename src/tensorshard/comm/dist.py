"""The torchrun engine's `Comm`: the collectives a style asks for, on a torch.distributed process group.

One process per device runs one shard; shards meet in the collectives of the tensor-parallel group (one
dimension of a DeviceMesh). Every collective with a backward is a node of comm/functions.py over this rank's raw
collectives (comm/process_group.py), so a backward pass issues exactly the collectives the SPMD convention of
comm/interface.py implies, in the same order on every rank (every rank runs the same graph):

    all_reduce        forward: all-reduce             backward: nothing
    copy_to_parallel  forward: nothing                backward: all-reduce
    all_gather        forward: all-gather (padded)    backward: nothing (own slice)
    split             forward: nothing (own slice)    backward: all-gather
    tie               forward: nothing                backward: one all-reduce, each sharer group's sum
    reduce_scatter    forward: reduce-scatter         backward: all-gather
    gather_sequence   forward: all-gather             backward: reduce-scatter (or own slice, see below)

What this file owns is the per-call state around them. `copy_to_parallel` runs once per input tensor per call
of the root module, so q, k and v reading the same tensor share one backward all-reduce. The engine brackets
root calls with `begin_call` / `end_call`; a submodule called on its own caches nothing (more backward
all-reduces, still exact). When column layers read the output of `gather_sequence`, `copy_to_parallel` claims
it instead: no node of its own, and the gather's backward becomes a reduce-scatter of their partial gradients
(read by anything else, its gradient is whole and the backward just keeps this rank's slice).

Parameters whose gradients are partial sums (`partial_grads`: norms running on sequence shards) go through
comm/grad_bucket.py: one all-reduce per backward pass for all of them. While torch.compile traces, the
collectives are comm/dist_ops.py's operators instead, with the same sharing: the traced copy_to_parallel is
remembered on the tensor it copies (an attribute dynamo traces, where the dictionaries above are keyed by storage
addresses it cannot read), and a gathered sequence read by column layers is claimed through `claim_sequence`.
Every collective is reported to `comm/counter.record` once.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..partition import Partition
from . import dist_ops, functions, graph_collectives
from .dist_guard import guard_for
from .dtensor import as_dtensor, mesh_device
from .functions import Gathered
from .grad_bucket import DeferGrad, PartialGradBucket
from .interface import Comm
from .process_group import RankCollectives, check_even
from .thread_ops import flat_groups, layout_of
from .transport import connect

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


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
        self.backend = str(dist.get_backend(self.group))  # (read while tracing: comm/graph_collectives.py)
        self.rank = mesh.get_local_rank()
        self.world_size = mesh.size()
        self.guard = guard_for(self.group)
        self.raw = RankCollectives(self.group, self.rank, self.world_size)  # what the autograd nodes call
        self.guard.set_timeout(timeout)
        if self.world_size > 1:
            connect(self.guard, mesh.device_type)  # shared memory between CPU ranks of one host
        self.bucket = PartialGradBucket(self.group)
        self.partial: set[tuple[int, str]] = set()  # (id(module), name) of parameters with partial grads
        self._depth = 0
        # this call's tensors by _alias_key (the tensors are kept so their memory is not reused meanwhile)
        self._parallel: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._gathered: dict[tuple, tuple[torch.Tensor, Gathered]] = {}
        self._left_split: set[str] = set()  # all_gather sites that return the local slice (leave_split)
        # while torch.compile traces: the latest gathered sequence (gather_sequence's output and its input), for a
        # view of it read by column layers (dynamo keeps a tensor's attributes, not those of its `_base`)
        self._traced_gathered: tuple[torch.Tensor, torch.Tensor, int, str] | None = None

    # -- per-call state ----------------------------------------------------------------------------------

    def begin_call(self) -> None:
        if self._depth == 0:
            self._parallel, self._gathered = {}, {}
        self._depth += 1

    def end_call(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._parallel, self._gathered = {}, {}  # release the call's tensors

    def end_traced_call(self) -> None:
        """The end of a root call that torch.compile traced: forget its gathered sequence."""
        self._traced_gathered = None

    # -- the collectives -----------------------------------------------------------------------------------

    # While torch.compile traces (torch.compiler.is_compiling()), every collective is one of comm/dist_ops.py's
    # ops: the graph holds the call. The per-call bookkeeping below (Python dicts keyed by storage addresses)
    # becomes attributes of the traced tensors (`_traced_copy`). A call without autograd on CPU ranks of one
    # host (a compiled decode step) takes the native collectives instead (comm/native/: C++, no Python per
    # collective) once transport.connect_native has set guard.native; one on CUDA ranks of an NCCL group, inside
    # the decode step's wrapper, takes torch's functional collectives, which CUDA graphs capture
    # (comm/graph_collectives.py).

    def all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        if torch.compiler.is_compiling():
            native = self._native(x)
            if native is not None:
                return torch.ops.tensorshard.native_all_reduce.default(x, native, self.rank, where)
            if graph_collectives.applies(x, self.backend):  # NCCL inside the CUDA graphs of a decode step
                return graph_collectives.all_reduce(x, self.group_name, where)
            return dist_ops.all_reduce(x, self.group_name, where)
        return functions.all_reduce(self.raw, where, x)[0]

    def compiling_all_reduce(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        """`all_reduce`'s branch for a call dynamo traces without gradients (comm/interface.py)."""
        if self.world_size == 1:
            return x
        native = self.guard.native  # (`_native`, without gradients)
        if native is not None and x.device.type == "cpu":
            return torch.ops.tensorshard.native_all_reduce.default(x, native, self.rank, where)
        if graph_collectives.applies(x, self.backend):
            return graph_collectives.all_reduce(x, self.group_name, where)
        return dist_ops.all_reduce(x, self.group_name, where)

    def copy_to_parallel(self, x: torch.Tensor, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1 or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        if torch.compiler.is_compiling():
            return self._traced_copy(x, where)
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
        y = functions.copy_to_parallel(self.raw, where, x)[0]
        if self._depth:
            self._parallel[key] = (x, y)
        return y

    def _traced_copy(self, x: torch.Tensor, where: str) -> torch.Tensor:
        """copy_to_parallel while torch.compile traces: one node per input tensor as in eager (q, k and v, gate and
        up share one backward all-reduce), remembered on the tensor; a gathered sequence (or a view of it) is
        claimed instead, its column layers' partial gradients reduce-scattered (one collective, as in eager)."""
        hit = getattr(x, "_tensorshard_parallel_copy", None)
        if hit is not None:
            return hit
        gathered = getattr(x, "_tensorshard_gathered", None)
        if gathered is not None:
            shard, dim, gather_where = gathered
            y = dist_ops.claim_sequence(x, shard, self.group_name, self.rank, self.world_size, dim, gather_where)
        elif self._whole_view_of_gathered(x):
            # a view of the whole gathered sequence (transformers' `hidden_states[:, slice(0, None)]` before the
            # head): claimed as the sequence itself. A view of part of it (fewer tokens) falls to the plain copy
            # below: its all-reduce and the gather's own backward give the same gradient, one collective other
            # than eager's reduce-scatter.
            _, shard, dim, gather_where = self._traced_gathered
            self._traced_gathered = None  # released: the slot holds a tensor of the graph
            y = dist_ops.claim_sequence(x, shard, self.group_name, self.rank, self.world_size, dim, gather_where)
        else:
            y = dist_ops.copy_to_parallel(x, self.group_name, where)
        x._tensorshard_parallel_copy = y
        return y

    def _whole_view_of_gathered(self, x: torch.Tensor) -> bool:
        """`x` is a view of all of the latest traced gather_sequence's output (same shape and strides)."""
        gathered = self._traced_gathered
        if gathered is None or x._base is None or x._base is not gathered[0]:
            return False
        return tuple(x.shape) == tuple(gathered[0].shape) and x.stride() == gathered[0].stride()

    def all_gather(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1 or where in self._left_split:
            return x
        if torch.compiler.is_compiling():
            return self._traced_gather(x, dim, partition, where)
        return functions.all_gather(self.raw, where, partition, dim, x)[0]

    def _native(self, x: torch.Tensor) -> int | None:
        """The native group to run a traced collective of `x` on, when it needs no autograd; else None."""
        native = self.guard.native
        if native is None or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
            return None
        return native

    def _traced_gather(self, x: torch.Tensor, dim: int, partition: Partition, where: str) -> torch.Tensor:
        """`all_gather` as comm/dist_ops.py's op: each rank's piece padded to the longest, as gather_pieces does;
        or as the native op, which takes uneven pieces and joins them in rank order."""
        sizes = [partition.local_size(r) for r in range(self.world_size)]
        native = self._native(x)
        if native is not None:
            dim = dim % x.dim()
            joined = torch.ops.tensorshard.native_all_gather.default(x, native, self.rank, dim, sizes, where)
            starts = [ranges[0][0] for ranges in partition.ranges]
            if not partition.overlapping and all(len(r) == 1 for r in partition.ranges) and starts == sorted(starts):
                return joined  # rank order is index order: the joined pieces are the whole tensor
            return partition.assemble(list(joined.split(sizes, dim)), dim)
        longest = max(sizes)
        piece = x.movedim(dim, 0)
        if piece.shape[0] < longest:
            piece = torch.cat([piece, piece.new_zeros((longest - piece.shape[0], *piece.shape[1:]))])
        if graph_collectives.applies(piece, self.backend):  # NCCL inside the CUDA graphs of a decode step
            stacked = graph_collectives.all_gather(piece, self.group_name, self.world_size, where)
        else:
            stacked = dist_ops.all_gather(piece, self.group_name, self.world_size, self.rank, where)  # (world * longest, ..)
        pieces = [stacked.narrow(0, r * longest, n).movedim(0, dim) for r, n in enumerate(sizes)]
        return partition.assemble(pieces, dim)

    def gather_small(self, x: torch.Tensor, *, where: str = "") -> list[torch.Tensor]:
        """Every rank's copy of a small 1-D tensor (no autograd), in rank order: for agreeing on metadata."""
        if self.world_size == 1:
            return [x]
        local = x.to(mesh_device(self.mesh))
        rows = self.raw.gather_even((local.reshape(1, -1),), 0, where=where, phase="forward")[0]
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
        if torch.compiler.is_compiling():
            dim = dim % x.dim()
            return dist_ops.split(x, self.group_name, self.rank, self.world_size, dim, layout_of(partition), where)
        return functions.split(self.raw, where, partition, dim, x)[0]

    def tie(self, x: torch.Tensor, groups: list[list[int]], *, where: str = "") -> torch.Tensor:
        if self.world_size == 1 or not groups or not (torch.is_grad_enabled() and x.requires_grad):
            return x
        if torch.compiler.is_compiling():
            return dist_ops.tie(x, self.group_name, self.rank, self.world_size, flat_groups(groups), where)
        return functions.tie(self.raw, where, groups, x)[0]

    # -- sequence parallelism --------------------------------------------------------------------------------

    def reduce_scatter(self, x: torch.Tensor, dim: int, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        check_even(x, dim, self.world_size, where)
        if torch.compiler.is_compiling():
            return dist_ops.reduce_scatter(x, self.group_name, self.rank, self.world_size, dim, where)
        return functions.reduce_scatter(self.raw, where, dim, x)[0]

    def gather_sequence(self, x: torch.Tensor, dim: int, *, where: str = "") -> torch.Tensor:
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        if torch.compiler.is_compiling():
            y = dist_ops.gather_sequence(x, self.group_name, self.rank, self.world_size, dim, where)
            if torch.is_grad_enabled() and x.requires_grad:
                y._tensorshard_gathered = (x, dim, where)  # column layers reading it claim it (_traced_copy)
                self._traced_gathered = (y, x, dim, where)
            return y
        if not (torch.is_grad_enabled() and x.requires_grad):
            return self.raw.gather_even((x,), dim, where=where, phase="forward")[0]
        state = Gathered()
        y = functions.GatherSequence.apply(self.raw, where, dim, state, x)[0]
        if self._depth:
            self._gathered[_alias_key(y)] = (y, state)
        return y

    def partial_grads(self, module, names, *, where: str = "") -> None:
        self.partial.update((id(module), name) for name in names)

    def deferred_slot(self, owner, table_name: str, name: str) -> int:
        """The number that names the parameter `owner.<table_name>[name]` (whose gradient is partial) and this
        comm's bucket in compiled graphs (comm/dist_ops.py's `defer_grad`); the engine asks once per parameter."""
        return dist_ops.deferred_slot(self.bucket, owner, table_name, name)

    def defer_grad(self, local: torch.Tensor, param, *, on_the_spot: bool = False, slot: int = 0,
                   where: str = "") -> torch.Tensor:
        """The local view of a parameter whose gradient is a partial sum over the group: summed in the
        end-of-backward bucket, or with `on_the_spot` (FSDP2, which reads a module's gradients right after
        its backward) by its own all-reduce during backward. Traced, the bucket is reached through `slot`
        (`deferred_slot`)."""
        if self.world_size == 1 or not (torch.is_grad_enabled() and local.requires_grad):
            return local
        if torch.compiler.is_compiling():
            if on_the_spot:
                return dist_ops.copy_to_parallel(local, self.group_name, where)
            if not slot:
                _refuse_traced("partial gradients without a slot (deferred_slot)", where)
            return dist_ops.defer_grad(local, slot, where)
        if on_the_spot:
            return functions.copy_to_parallel(self.raw, where, local)[0]  # unbucketed: all-reduced on the spot
        return DeferGrad.apply(local, self.bucket, param)

    # -- loss parallelism ------------------------------------------------------------------------------------

    def as_sharded(self, x: torch.Tensor, dim: int, partition: Partition, *, where: str = ""):
        return as_dtensor(x, dim % x.dim(), partition, self.mesh, where=where)


def _refuse_traced(kind: str, where: str) -> None:
    """Collectives that comm/dist_ops.py does not provide (here: with autograd on) refuse to be traced."""
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            f"{where or 'a module'}: {kind} cannot be compiled. Parallelize the model with tensorshard.parallelize "
            "(which sets up every partial gradient), or run this model without torch.compile"
        )
