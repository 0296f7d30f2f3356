"""How the torchrun engine's collectives travel, and how torch's CommDebugMode sees them.

    connect(guard, "cpu")                            # once per group, on every rank (DistComm does it)
    connect_native(guard)                            # before compiling: guard.native for compiled graphs, or None;
                                                     # at every compiled call: restored after a failure (recovery.py)
    all_reduce_(t, group, "sum", what="all_reduce at w2")
    all_gather_(out, piece, group, what=...)         # out: the world's pieces stacked on dim 0
    reduce_scatter_(out, inp, group, what=...)

Compiled graphs (comm/dist.py while torch.compile traces, no autograd) call the native collectives instead
(comm/native/: C++ operators over a region of the same segment, no Python per collective) once
`connect_native` has given the guard a native group: on every rank or on none.

Transports: when every rank of the group is a CPU process of one host, shared memory (comm/shm.py, set up
by comm/shm_setup.py: one barrier through the kernel per round, no TCP); otherwise, and for what shared
memory does not handle, the process group's own backend (gloo, NCCL). Either way the call goes through the group's guard
(comm/dist_guard.py): bounded, and failures name the rank and the operation. TENSORSHARD_SHM=0 keeps
everything on the backend.

CommDebugMode: each of these collectives shows to an active `CommDebugMode` as the functional collective of
its kind (`funcol.all_reduce`, `funcol.all_gather_into_tensor`, `funcol.reduce_scatter_tensor`: the keys
DTensor's own collectives have), with its shape and module, whatever the transport; the transport's own
operations stay hidden from the mode (so a gloo collective is not counted twice). The mode sees a meta
tensor of the collective's shape: no data moves for it.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from ..logs import get_logger
from .dist_guard import GroupGuard, collective, guard_for
from . import recovery, shm_setup
from .native import ops as native_ops

logger = get_logger(__name__)

# torch 2.13 renamed the single-tensor collectives; 2.10-2.12 have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_OPS = ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.MIN, "min"), (dist.ReduceOp.PRODUCT, "product"))
_functional = torch.ops._c10d_functional


def connect(guard: GroupGuard, device_type: str) -> None:
    """Give `guard`'s group a shared-memory transport when all its ranks are CPU processes of this host.
    Collective: every rank of the group calls it at the same point; they all get one, or none."""
    if guard.shm is not None or len(guard.ranks) < 2 or device_type != "cpu" or guard.store is None:
        return  # the mesh's device type and the group are the same on every rank: they all return here
    pids = guard.local_pids()
    rank = guard.ranks.index(guard.rank)
    guard.shm = shm_setup.connect(guard.store, rank=rank, world=len(guard.ranks), pids=pids,
                                  wait=_waiter(guard), label=guard.label)


def connect_native(guard: GroupGuard) -> int | None:
    """The native collectives' group of `guard`'s group (set as `guard.native`), when it has a shared-memory
    transport and every rank loaded the native library; else None, with the reason logged. Collective: every
    rank of the group calls it at the same point (the first call agrees, later calls return what it agreed, after
    restoring it where a failure the ranks went through together marked it failed, comm/recovery.py: GroupOutOfStep
    where they did not)."""
    if guard.native_asked:
        recovery.restore(guard)  # (one read of the shared segment while the group is well)
        return guard.native
    guard.native_asked = True
    shm = guard.shm
    if shm is None:
        return None  # the same on every rank: connect() agreed on it
    loaded = native_ops.available()
    if not shm_setup.agree(guard.store, rank=shm.rank, world=shm.world, ok=loaded, wait=_waiter(guard)):
        if loaded and shm.rank == 0:
            logger.warning("%s: native collectives off: another rank could not load them (its log says why); "
                           "compiled graphs call the Python collectives", guard.label)
        return None
    guard.native = native_ops.process_group(shm, timeout=guard.timeout)
    if shm.rank == 0:
        logger.debug("%s: compiled graphs call the native collectives", guard.label)
    return guard.native


def _waiter(guard: GroupGuard):
    """shm_setup's wait for store keys: ({key: group index of the rank writing it}) -> None, within the guard's
    limit, naming the ranks that did not write theirs."""
    return lambda keys: guard.wait_keys({k: guard.ranks[i] for k, i in keys.items()}, "parallelize")


def op_name(op) -> str | None:
    return next((name for known, name in _OPS if op == known), None)


# --- the collectives --------------------------------------------------------------------------------------


def all_reduce_(t: torch.Tensor, group, op=dist.ReduceOp.SUM, *, what: str) -> None:
    """`t` becomes the reduction of every rank's `t` (in place)."""
    guard = guard_for(group)
    name = op_name(op)
    watched = _comm_debug_mode_on()
    if watched:
        _functional.all_reduce(_meta(t), name or "sum", group.group_name)
    with _hidden(watched):
        shm = guard.shm
        if shm is not None and name is not None and shm.can_reduce(t, name):
            guard.run(what, t.device, lambda _: shm.all_reduce(t, name, limit=guard.timeout, what=what))
        else:
            collective(dist.all_reduce, t, t, op=op, group=group, what=what)


def all_gather_(out: torch.Tensor, piece: torch.Tensor, group, *, what: str) -> None:
    """`out` (world x piece, stacked on dim 0) becomes every rank's `piece` in rank order."""
    guard = guard_for(group)
    watched = _comm_debug_mode_on()
    if watched:
        _functional.all_gather_into_tensor(_meta(piece), len(guard.ranks), group.group_name)
    with _hidden(watched):
        shm = guard.shm
        if shm is not None and shm.can_copy(out, piece):
            guard.run(what, out.device, lambda _: shm.all_gather(out, piece, limit=guard.timeout, what=what))
        else:
            collective(all_gather_single, out, out, piece, group=group, what=what)


def reduce_scatter_(out: torch.Tensor, inp: torch.Tensor, group, *, what: str) -> None:
    """`out` becomes this rank's block (dim 0) of the sum of every rank's `inp`."""
    guard = guard_for(group)
    watched = _comm_debug_mode_on()
    if watched:
        _functional.reduce_scatter_tensor(_meta(inp), "sum", len(guard.ranks), group.group_name)
    with _hidden(watched):
        shm = guard.shm
        if shm is not None and shm.can_copy(out, inp) and shm.can_reduce(inp, "sum"):
            guard.run(what, out.device, lambda _: shm.reduce_scatter(out, inp, limit=guard.timeout, what=what))
        else:
            collective(reduce_scatter_single, out, out, inp, group=group, what=what)


# --- CommDebugMode ------------------------------------------------------------------------------------------


def _comm_debug_mode_on() -> bool:
    """A CommDebugMode is active in this thread (one C call when no dispatch mode is)."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    # Not imported here: torch.distributed.tensor.debug imports numpy (its sharding visualizer), which torch
    # does not depend on. Whoever made a CommDebugMode has imported that module already.
    debug = sys.modules.get("torch.distributed.tensor.debug")
    return debug is not None and any(isinstance(m, debug.CommDebugMode) for m in _get_current_dispatch_mode_stack())


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


class _hidden:
    """Dispatch modes off while the transport runs, when a CommDebugMode watches (it saw the collective already)."""

    def __init__(self, on: bool) -> None:
        self.context = _disable_current_modes() if on else None

    def __enter__(self) -> None:
        if self.context is not None:
            self.context.__enter__()

    def __exit__(self, *exc) -> None:
        if self.context is not None:
            self.context.__exit__(*exc)
