"""Setting up the shared-memory transport of a process group (comm/shm.py), on every rank at the same point.

    shm = connect(store, rank=r, world=n, pids=pids, wait=wait, label="group [0, 1]")   # or None everywhere

Group rank 0 makes a private folder (in /dev/shm where it can write there) holding the segment, allocated at
once so that a full /dev/shm fails here rather than with SIGBUS in a collective, and one FIFO per rank. Every
rank maps the segment and opens its own FIFO, then the write ends of its peers' FIFOs. After each step the
ranks agree through the group's store, so either every rank gets the transport or none does (and gloo carries
every collective): a rank that cannot map the segment or open a FIFO says so at debug level and the group
goes on without it. Rank 0 then removes the folder; every rank holds open what it needs, and a crash leaves
nothing behind. TENSORSHARD_SHM=0 turns the transport off.

Sizes: at most `BUDGET` bytes per group, two buffer sets of N slots plus a result area, a slot between
`MIN_SLOT` and `MAX_SLOT` (64-byte aligned), and a header per rank and set. After them, the region of the native
collectives (comm/native/ops.py: what compiled graphs call; its own flags and slots, so the two never meet).
"""

from __future__ import annotations

import mmap
import os
import select
import shutil
import tempfile
from typing import Callable

from ..logs import get_logger
from ..switches import switched_on
from .native.ops import region_bytes as native_region_bytes
from .shm import HEADER, SharedMemoryGroup

logger = get_logger(__name__)

ENV = "TENSORSHARD_SHM"  # "0": every collective through the process group's backend (gloo)
BUDGET = 32 << 20  # at most this many bytes per group: 2 buffer sets x (N slots + result area)
MAX_SLOT, MIN_SLOT = 2 << 20, 64 << 10  # 2 MiB: a (4, 128, 1024) fp32 activation in one round; 12 MiB at 2 ranks
ALIGN = 64
PREFIX = "tensorshard/shm/"

Wait = Callable[[dict[str, int]], None]  # waits for store keys: {key: group index of the rank that writes it}


def enabled() -> bool:
    """False when TENSORSHARD_SHM=0 (or another false word): gloo for every collective."""
    return switched_on(ENV)


def supported() -> bool:
    """This platform has what the transport needs: FIFOs, poll() and /dev/shm or a temporary folder."""
    return hasattr(os, "mkfifo") and hasattr(select, "poll") and hasattr(os, "posix_fallocate")


def connect(store, *, rank: int, world: int, pids: list[int] | None, wait: Wait,
            label: str = "") -> SharedMemoryGroup | None:
    """The group's transport on every rank, or None on every rank (then gloo carries the collectives).
    `pids`: every rank's process id when all ranks run on this host (else None). Agreement goes through the
    group's `store`; group rank 0 creates the segment and the FIFOs. `wait` waits for store keys (the group's
    guard: within its time limit, naming the ranks that did not write theirs)."""
    call = store.add(f"{PREFIX}connects/{rank}", 1)  # equal on all ranks: they connect in the same order
    key = f"{PREFIX}{call}/"
    usable = pids is not None and enabled() and supported() and world <= 255
    folder = ""
    if rank == 0:
        folder, why = _create(world) if usable else ("", "not every rank is a CPU process of this host"
                                                     if pids is None else "turned off or unsupported here")
        store.set(key + "folder", folder or f"-{why}")
    else:
        wait({key + "folder": 0})
        folder = store.get(key + "folder").decode()
    opened = None
    if usable and not folder.startswith("-"):
        try:
            opened = _open(folder, rank, world)
        except OSError as e:
            logger.debug("rank %d of %s cannot open the shared-memory segment (%s): gloo instead", rank, label, e)
    ok = _agree(store, key + "opened/", rank, world, opened is not None, wait)
    peers: dict[int, int] = {}
    if ok:
        try:
            peers = {r: os.open(os.path.join(folder, f"fifo{r}"), os.O_WRONLY) for r in range(world) if r != rank}
        except OSError as e:
            logger.debug("rank %d of %s cannot open a peer's FIFO (%s): gloo instead", rank, label, e)
            peers = {}
        ok = _agree(store, key + "ready/", rank, world, len(peers) == world - 1, wait)
    if rank == 0 and folder and not folder.startswith("-"):
        shutil.rmtree(folder, ignore_errors=True)  # every rank has opened it (or given up): unlink it all
    if not ok:
        for fd in peers.values():
            os.close(fd)
        if opened is not None:
            opened[0].close()
            os.close(opened[1])
        if rank == 0:
            logger.debug("%s: collectives through gloo (%s)", label, folder.lstrip("-") or "the ranks could not all map the segment")
        return None
    segment, fifo = opened
    slot = _slot_bytes(world)
    if rank == 0:
        logger.debug("%s: collectives through shared memory (%d ranks, slots of %d KiB)", label, world, slot >> 10)
    group = SharedMemoryGroup(rank, world, segment, slot, fifo, peers, list(pids))
    group.native_offset, group.native_bytes = _python_bytes(world), native_region_bytes(world)
    return group


def _slot_bytes(world: int) -> int:
    slot = BUDGET // (2 * (world + 1)) // ALIGN * ALIGN
    return max(MIN_SLOT, min(MAX_SLOT, slot))


def _python_bytes(world: int) -> int:
    """The part of the segment that comm/shm.py uses (a multiple of 64: the native region follows, aligned)."""
    return 2 * (world + 1) * _slot_bytes(world) + 2 * world * HEADER


def _segment_bytes(world: int) -> int:
    return _python_bytes(world) + native_region_bytes(world)


def _create(world: int) -> tuple[str, str]:
    """Group rank 0: a private folder holding the segment (allocated now: a full /dev/shm fails here, not with
    SIGBUS later) and one FIFO per rank. Returns (folder, '') or ('', why not)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    folder = None
    try:
        folder = tempfile.mkdtemp(prefix="tensorshard-", dir=base)
        fd = os.open(os.path.join(folder, "segment"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, _segment_bytes(world))
        finally:
            os.close(fd)
        for r in range(world):
            os.mkfifo(os.path.join(folder, f"fifo{r}"), 0o600)
        return folder, ""
    except OSError as e:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
        return "", f"could not create the segment: {e}"


def _open(folder: str, rank: int, world: int) -> tuple[mmap.mmap, int]:
    """Map the segment and open our FIFO (read and write: never at end-of-file, never blocks to open)."""
    fd = os.open(os.path.join(folder, "segment"), os.O_RDWR)
    try:
        segment = mmap.mmap(fd, _segment_bytes(world))
    finally:
        os.close(fd)
    fifo = os.open(os.path.join(folder, f"fifo{rank}"), os.O_RDWR | os.O_NONBLOCK)
    return segment, fifo


def agree(store, *, rank: int, world: int, ok: bool, wait: Wait) -> bool:
    """True on every rank of the group when `ok` is True on every rank (all call it at the same point)."""
    call = store.add(f"{PREFIX}agree/{rank}", 1)  # equal on all ranks: they agree in the same order
    return _agree(store, f"{PREFIX}agree/{call}/", rank, world, ok, wait)


def _agree(store, key: str, rank: int, world: int, ok: bool, wait: Wait) -> bool:
    """True on every rank when `ok` is True on every rank."""
    store.set(f"{key}{rank}", "1" if ok else "0")
    keys = [f"{key}{r}" for r in range(world)]
    wait({k: r for r, k in enumerate(keys)})
    return all(store.get(k) == b"1" for k in keys)
