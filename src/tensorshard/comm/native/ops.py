"""The native collectives' Python side: their groups, their shapes for tracing, and their counts.

The operators (C++, collectives.cpp; built on first use by library.py) run without Python, so a compiled graph that
calls them never takes the GIL for a collective:

    torch.ops.tensorshard.native_all_reduce(x, group, rank, where)             -> the sum over the ranks (new tensor)
    torch.ops.tensorshard.native_all_gather(x, group, rank, dim, sizes, where) -> pieces joined along `dim`

`group` is an int naming a region the ranks share, `rank` the caller's rank in it (0..world-1), `where` a label
(the module's name) shown in errors and in `tp.count_collectives()`'s log. The all-reduce sums in rank order
0..N-1 (((x0 + x1) + x2) ...: the bits of the eager collectives, comm/reduce.py and comm/shm.py); the all-gather
takes rank r's piece with `sizes[r]` rows along `dim` (uneven pieces are fine) and joins them in rank order.
Neither carries autograd: they serve no-gradient calls (decoding, evaluation).

Two kinds of group:

    group = ThreadGroup(world=2, timeout=300)    # in-process: threads of this process over a heap region
    y = torch.ops.tensorshard.native_all_reduce(x, group.handle, rank, "layers.0.mlp")   # in rank `rank`'s thread
    group.abort(rank, "shard 1 raised ...")      # a failed rank: the others' waits raise at once
    group.close()                                # (also when the object is collected)

    handle = process_group(shm, timeout=300)     # torchrun: CPU ranks of one host, over comm/shm.py's segment
    broken(shm)                                  # 0, or 1 + the rank that marked it failed (a read of the segment)
    reset(handle)                                # usable again: every rank, between two meetings (comm/recovery.py)

`available()` builds and loads the library (once per machine, then cached); False, with the reason logged once,
where no compiler is found or the build fails: callers keep the Python collectives then.
"""

from __future__ import annotations

import sys
import threading
import weakref

import torch

from . import library

BROKEN_AT = 8  # byte offset of a region's `broken` word (collectives.cpp's Control: after the 8-byte magic)
THREAD_SLOT = 1 << 20  # bytes per rank and buffer set of a ThreadGroup: larger tensors take several rounds
PROCESS_SLOT = 512 << 10  # ... of a process group's region in the shared segment (comm/shm_setup.py)

_registered = threading.Lock()
_fakes_done = False
_on_load: list = []  # called with the native log once the library is loaded (comm/counter.py registers)


def available() -> bool:
    """True once the native operators are loaded in this process (built on first call, cached per machine)."""
    if not library.load():
        return False
    _register_fakes()
    return True


def why_not() -> str:
    """Why `available()` is False ('' when it is True)."""
    return library.why_not()


def region_bytes(world: int, slot: int = PROCESS_SLOT) -> int:
    """Bytes of a region for `world` ranks with slots of `slot` bytes (the layout is collectives.cpp's). Pure
    arithmetic, mirrored here so that comm/shm_setup.py can size its segment without loading the library."""
    control, words, header = 512, 128, 64
    return control + world * words + 2 * world * header + 2 * world * slot


class ThreadGroup:
    """A native group whose ranks are threads of this process, over a heap region it owns.

    `world`: ranks (threads); `timeout`: seconds a rank waits for the others before it raises; `slot`: bytes per
    rank and round (larger tensors take several rounds)."""

    def __init__(self, world: int, *, timeout: float = 300.0, slot: int = THREAD_SLOT) -> None:
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"ThreadGroup(world={world!r}): world must be an int >= 1 (the number of ranks)")
        if not timeout > 0:
            raise ValueError(f"ThreadGroup(timeout={timeout!r}): a time limit in seconds > 0")
        if slot < 4096 or slot % 64:
            raise ValueError(f"ThreadGroup(slot={slot!r}): bytes per rank and round, >= 4096 and a multiple of 64")
        if not available():
            raise RuntimeError(f"native collectives are unavailable here ({why_not()}); check "
                               "tensorshard.comm.native.ops.available() first and use the Python collectives")
        self.world = world
        self.handle = int(torch.ops.tensorshard.native_thread_group(world, slot, float(timeout)))
        self._finalizer = weakref.finalize(self, _close, self.handle)

    def abort(self, rank: int, reason: str) -> None:
        """Mark the group failed (by `rank`, for `reason`): every rank waiting in it, or entering it later, raises."""
        torch.ops.tensorshard.native_group_abort(self.handle, rank, reason)

    def close(self) -> None:
        """Free the region (graphs still naming it raise when called)."""
        self._finalizer()


def process_group(shm, *, timeout: float) -> int:
    """A native group over the region that comm/shm_setup.py reserved in `shm`'s segment (a SharedMemoryGroup):
    this process is group rank `shm.rank`. Its handle lives as long as `shm` does."""
    base = torch.frombuffer(shm.segment, dtype=torch.uint8).data_ptr() + shm.native_offset
    handle = int(torch.ops.tensorshard.native_process_group(base, shm.native_bytes, shm.rank, shm.world,
                                                            float(timeout), list(shm.pids)))
    weakref.finalize(shm, _close, handle)
    return handle


def broken(shm) -> int:
    """0, or 1 + the rank that marked the native group in `shm`'s segment failed: read from the segment itself (an
    operator call costs microseconds, and this runs at every compiled decode call)."""
    at = shm.native_offset + BROKEN_AT
    return int.from_bytes(shm.segment[at : at + 8], sys.byteorder, signed=True)


def reset(handle: int) -> None:
    """Group `handle` serves collectives again, under the same handle. Every rank calls it, after all ranks have
    met outside the group's collectives and before any starts another (comm/recovery.py)."""
    torch.ops.tensorshard.native_group_reset(handle)


def abort(handle: int, rank: int, reason: str) -> None:
    """Mark group `handle` failed: its ranks' waits raise at once (a process group: every process's)."""
    torch.ops.tensorshard.native_group_abort(handle, rank, reason)


def _close(handle: int) -> None:
    try:
        torch.ops.tensorshard.native_group_close(handle)
    except (AttributeError, RuntimeError):  # interpreter shutdown
        pass


# --- tracing and counting --------------------------------------------------------------------------------


def _register_fakes() -> None:
    """Shapes for tracing (FakeTensor) and the counter's reader; once per process."""
    global _fakes_done
    if _fakes_done:
        return
    with _registered:
        if _fakes_done:
            return
        torch.library.register_fake("tensorshard::native_all_reduce", _all_reduce_shape)
        torch.library.register_fake("tensorshard::native_all_gather", _all_gather_shape)
        _fakes_done = True
        for call in _on_load:
            call(NativeCounts())


def when_loaded(call) -> None:
    """`call(NativeCounts())` once the library is loaded (now, if it is): how comm/counter.py reads the C++ log
    without this package importing it."""
    with _registered:
        _on_load.append(call)
        loaded = _fakes_done
    if loaded:
        call(NativeCounts())


def _all_reduce_shape(x: torch.Tensor, group: int, rank: int, where: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_gather_shape(x: torch.Tensor, group: int, rank: int, dim: int, sizes: list[int], where: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = sum(sizes)
    return x.new_empty(shape)


class NativeCounts:
    """What comm/counter.py calls: the C++ side logs collectives while at least one counter is open."""

    def start(self) -> int:
        return int(torch.ops.tensorshard.native_count_start())

    def read(self, since: int) -> tuple[int, list[tuple[str, int, str]]]:
        text = torch.ops.tensorshard.native_count_read(since)
        entries = []
        for line in text.splitlines():
            kind, nbytes, where = line.split("\t", 2)
            entries.append((kind, int(nbytes), where))
        return since + len(entries), entries

    def stop(self) -> None:
        torch.ops.tensorshard.native_count_stop()
