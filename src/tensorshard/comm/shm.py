"""Shared-memory collectives for the CPU ranks of one host: how the torchrun engine's collectives travel when
every rank of a tensor-parallel group is a CPU process on the same machine, instead of gloo's TCP loopback
(a few hundred microseconds per collective even for a few KB, milliseconds for 2 MiB).

    shm = connect(store, rank=r, world=n, pids=pids, timeout=300)   # comm/shm_setup.py: every rank; or None
    work = shm.all_reduce(t, "sum", limit=300)      # in place; work.wait(timeout) / is_completed(), as gloo's

One segment per group, a file in /dev/shm that every rank maps (unlinked once all have it open, so nothing is
left behind by a crash: comm/shm_setup.py sets it up). It holds two buffer sets, used in alternate rounds; a set has one slot per rank and a
result area, `slot` bytes each. A round of a collective: every rank copies its piece (at most a slot) into its
own slot, the ranks meet at a barrier, and each reads what it needs:

    all_reduce      each rank combines the N slots in rank order 0..N-1 into its tensor (2 ranks, or rounds of
                    at most 64 KiB); otherwise rank r combines part r of the slots into the result area, a
                    second barrier, and every rank copies the result. Either way every element is combined in
                    one fixed order, so all ranks get the same bits, on every run (at 2 ranks, gloo's bits too:
                    a + b == b + a).
    all_gather      each rank copies the N slots, in rank order, into its output
    reduce_scatter  each rank combines its own part of the N slots, in rank order

Larger tensors take several rounds. With two buffer sets one barrier per round is enough: a rank writes a set
again two rounds later, after a barrier that every rank reached once done reading it. With its piece, each
rank writes what it is doing (kind, dtype, size, operation, and the caller's label) into its header; past the
barrier it compares the peers' headers with its own, so ranks that reached different collectives (different
code on different ranks) fail at once with `CollectivesDiffer`, naming what each peer was doing, instead of
mixing their data.

Barriers go through the kernel. Every rank owns a FIFO; a rank arriving at a barrier writes its rank number
(one byte) into every peer's FIFO, and passes once it has read, from each peer, as many bytes as barriers it
entered. A pipe write and the read that sees it order memory (the pipe's lock), so past the barrier every
peer's slot holds its data, whatever the CPU's memory model; and a waiting rank sleeps in poll() instead of
spinning, which matters when there are more ranks than cores.

Failures: a wait is sliced (`wait(timeout)` returns False when the slice runs out), so the caller
(comm/dist_guard.py) keeps reading failure reports between slices. A peer whose process ends is seen at once
(its pidfd turns readable, or writing to its FIFO fails) and `limit` seconds bound every collective; both fail
with a `SharedMemoryError` that the guard turns into its messages ("rank 1 is gone: ..."). After a failure the
group refuses further collectives.
"""

from __future__ import annotations

import mmap
import os
import select
import struct
import time
import weakref
import zlib
from datetime import timedelta
from typing import Callable, Iterator

import torch

SMALL = 64 << 10  # rounds of at most this many bytes are reduced by every rank itself (one barrier)
HEADER = 256  # bytes per rank and buffer set: what the rank is doing (4 int64) and its label (utf-8)
KINDS = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3}

COMBINE: dict[str, Callable] = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum, "product": torch.mul}


class SharedMemoryError(RuntimeError):
    """A shared-memory collective failed: a peer ended, the time limit passed, or the group failed before."""


class CollectivesDiffer(SharedMemoryError):
    """The ranks met at the same barrier inside different collectives. `elsewhere`: {group rank: what it did}."""

    def __init__(self, elsewhere: dict[int, str]) -> None:
        super().__init__("shared-memory collective: the ranks are at different collectives ("
                         + ", ".join(f"group rank {r} at {w}" for r, w in elsewhere.items()) + ")")
        self.elsewhere = elsewhere


class SharedMemoryGroup:
    """The shared-memory transport of one process group, in this process (group rank `rank` of `world`)."""

    def __init__(self, rank: int, world: int, segment: mmap.mmap, slot: int, fifo: int, peers: dict[int, int],
                 pids: list[int]) -> None:
        self.rank, self.world, self.slot = rank, world, slot
        self.segment = segment
        self.bytes = torch.frombuffer(segment, dtype=torch.uint8)  # the whole segment, as a tensor
        self.fifo = fifo  # ours, read end (non-blocking)
        self.peers = peers  # group rank -> write end of its FIFO
        self.pids = pids
        self.entered = 0  # barriers this rank entered
        self.heard = [0] * world  # bytes read from each peer (one per barrier it entered)
        self.rounds = 0
        self.broken: str | None = None
        self.native_offset = self.native_bytes = 0  # the native collectives' region (comm/shm_setup.py sets it)
        self._views: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}  # whole slots, typed
        self.poller = select.poll()
        self.poller.register(fifo, select.POLLIN)
        self.pidfds: dict[int, int] = {}  # fd -> group rank
        for r, pid in enumerate(pids):
            if r != rank and hasattr(os, "pidfd_open"):
                try:
                    fd = os.pidfd_open(pid)
                except OSError:  # an old kernel, or not allowed: liveness is read from /proc instead
                    continue
                self.pidfds[fd] = r
                self.poller.register(fd, select.POLLIN)
        weakref.finalize(self, _close, [fifo, *peers.values(), *self.pidfds])  # the mapping closes itself

    # -- the collectives (each returns a Work; the data moves as the Work is waited on) ------------------

    def can_reduce(self, t: torch.Tensor, op: str) -> bool:
        return op in COMBINE and t.dtype != torch.bool and t.is_contiguous() and t.device.type == "cpu"

    def can_copy(self, *tensors: torch.Tensor) -> bool:
        return all(t.is_contiguous() and t.device.type == "cpu" for t in tensors)

    def all_reduce(self, t: torch.Tensor, op: str = "sum", *, limit: float, what: str = "") -> "Work":
        """`t` (contiguous) becomes the combination of every rank's `t`."""
        tag = _tag("all_reduce", t, op, what)
        return Work(self, self._all_reduce(t.view(-1), COMBINE[op], tag), limit)

    def all_gather(self, out: torch.Tensor, piece: torch.Tensor, *, limit: float, what: str = "") -> "Work":
        """`out` (world x piece elements) becomes every rank's `piece`, in rank order."""
        tag = _tag("all_gather", piece, "", what)
        return Work(self, self._all_gather(out.view(self.world, -1), piece.reshape(-1), tag), limit)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum", *, limit: float,
                       what: str = "") -> "Work":
        """`out` (m elements) becomes part `rank` of the combination of every rank's `inp` (world x m)."""
        tag = _tag("reduce_scatter", inp, op, what)
        return Work(self, self._reduce_scatter(out.view(-1), inp.view(self.world, -1), COMBINE[op], tag), limit)

    def _all_reduce(self, flat: torch.Tensor, combine: Callable, tag: bytes) -> Iterator[None]:
        per_round = self.slot // flat.element_size()
        for start in range(0, flat.numel(), per_round):
            part = flat if flat.numel() <= per_round else flat[start : start + per_round]
            s = self._next_set()
            self._slot(s, self.rank, part).copy_(part)
            yield from self._meet(s, tag)
            slots = [self._slot(s, r, part) for r in range(self.world)]
            if self.world == 2 or part.numel() * part.element_size() <= SMALL:
                _combine_into(part, slots, combine)
            else:
                lo, hi = _span(part.numel(), self.world, self.rank)
                result = self._result(s, part)
                _combine_into(result[lo:hi], [x[lo:hi] for x in slots], combine)
                yield from self._barrier()
                part.copy_(result)

    def _all_gather(self, out: torch.Tensor, piece: torch.Tensor, tag: bytes) -> Iterator[None]:
        per_round = self.slot // piece.element_size()
        for start in range(0, piece.numel(), per_round):
            part = piece if piece.numel() <= per_round else piece[start : start + per_round]
            s = self._next_set()
            self._slot(s, self.rank, part).copy_(part)
            yield from self._meet(s, tag)
            for r in range(self.world):
                out[r, start : start + part.numel()].copy_(part if r == self.rank else self._slot(s, r, part))

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, combine: Callable, tag: bytes) -> Iterator[None]:
        per_round = max(1, self.slot // (inp.element_size() * self.world))  # each round: a block for every rank
        for start in range(0, out.numel(), per_round):
            block = inp[:, start : start + per_round]  # (world, k)
            s = self._next_set()
            mine = self._slot(s, self.rank, block.reshape(-1)).view(block.shape)
            mine.copy_(block)
            yield from self._meet(s, tag)
            k = block.shape[1]
            parts = [self._slot(s, r, block.reshape(-1)).view(self.world, k)[self.rank] for r in range(self.world)]
            _combine_into(out[start : start + k], parts, combine)

    # -- the segment ---------------------------------------------------------------------------------------

    def _next_set(self) -> int:
        self.rounds += 1
        return self.rounds % 2

    def _slot(self, s: int, r: int, like: torch.Tensor) -> torch.Tensor:
        """Rank r's slot in buffer set s (r = world: the result area), as `like`'s dtype and element count."""
        whole = self._views.get((s, r, like.dtype))
        if whole is None:
            start = (s * (self.world + 1) + r) * self.slot
            whole = self._views[(s, r, like.dtype)] = self.bytes[start : start + self.slot].view(like.dtype)
        return whole[: like.numel()]

    def _result(self, s: int, like: torch.Tensor) -> torch.Tensor:
        return self._slot(s, self.world, like)

    # -- the barrier -----------------------------------------------------------------------------------------

    def _meet(self, s: int, tag: bytes) -> Iterator[None]:
        """The barrier of a round, with our header in buffer set s before it and the peers' checked after."""
        start = self._header(s, self.rank)
        self.segment[start : start + HEADER] = tag
        yield from self._barrier()
        differ = {}
        for r in range(self.world):
            at = self._header(s, r)
            if r != self.rank and self.segment[at : at + 32] != tag[:32]:
                differ[r] = _describe(self.segment[at : at + HEADER])
        if differ:
            raise CollectivesDiffer(differ)

    def _header(self, s: int, r: int) -> int:
        return 2 * (self.world + 1) * self.slot + (s * self.world + r) * HEADER

    def _barrier(self) -> Iterator[None]:
        """Yields while peers have not arrived (the Work sleeps in poll() meanwhile)."""
        self.entered += 1
        mark = bytes([self.rank])
        for r, fd in self.peers.items():
            try:
                os.write(fd, mark)
            except BrokenPipeError:  # its read end closed: the process is gone
                raise self._gone(r) from None
        while True:
            self._read()
            if all(n >= self.entered for r, n in enumerate(self.heard) if r != self.rank):
                return
            yield

    def _read(self) -> None:
        try:
            data = os.read(self.fifo, 4096)
        except BlockingIOError:
            return
        for r in data:
            self.heard[r] += 1

    def _sleep(self, seconds: float) -> None:
        """Until a peer writes to our FIFO, a peer ends, or `seconds` pass."""
        for fd, _ in self.poller.poll(max(0.0, seconds) * 1000):
            if fd in self.pidfds:
                raise self._gone(self.pidfds[fd])

    def _check_peers(self) -> None:
        """Without pidfds: look for ended peers in /proc (a slice of waiting ran out)."""
        watched = set(self.pidfds.values())
        for r, pid in enumerate(self.pids):
            if r != self.rank and r not in watched and not process_alive(pid):
                raise self._gone(r)

    def _gone(self, r: int) -> SharedMemoryError:
        return SharedMemoryError(f"shared-memory collective: the connection to rank {r} closed: its process "
                                 f"{self.pids[r]} ended")

    def fail(self, error: BaseException) -> None:
        self.broken = self.broken or str(error)


class Work:
    """One collective in progress: `wait(timeout)` moves it on, sleeping at barriers for at most `timeout`;
    True once done. The interface of a process group's Work, as comm/dist_guard.py uses it."""

    def __init__(self, group: SharedMemoryGroup, steps: Iterator[None], limit: float) -> None:
        self.group, self.steps = group, steps
        self.began = time.monotonic()
        self.limit = limit
        self.done = False
        self.error: BaseException | None = None
        if group.broken is not None:
            self.error = SharedMemoryError(f"shared-memory collective: the group failed before ({group.broken})")

    def is_completed(self) -> bool:
        return self.done or self.error is not None

    def wait(self, timeout: timedelta | None = None) -> bool:
        until = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while True:
            if self.error is not None:
                raise self.error
            if self.done:
                return True
            try:
                next(self.steps)
            except StopIteration:
                self.done = True
                return True
            except BaseException as e:  # a peer gone, an interrupt: the group is out of step for good
                self._fail(e)
                raise
            now = time.monotonic()
            if now - self.began > self.limit:
                self._fail(SharedMemoryError(f"shared-memory collective timed out after {now - self.began:.3g} s"))
                raise self.error
            if until is not None and now >= until:
                self._check()
                return False
            end = self.began + self.limit if until is None else min(until, self.began + self.limit)
            try:
                self.group._sleep(end - now)
            except BaseException as e:  # a peer gone, or an interrupt: the group is out of step for good
                self._fail(e)
                raise

    def _check(self) -> None:
        try:
            self.group._check_peers()
        except SharedMemoryError as e:
            self._fail(e)
            raise

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self.group.fail(error)


# --- helpers --------------------------------------------------------------------------------------------------


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _combine_into(out: torch.Tensor, parts: list[torch.Tensor], combine: Callable) -> None:
    """out = ((parts[0] . parts[1]) . parts[2]) ...: one fixed order (out may alias none of the parts but the first)."""
    combine(parts[0], parts[1], out=out)
    for p in parts[2:]:
        combine(out, p, out=out)


def _span(n: int, world: int, r: int) -> tuple[int, int]:
    """Rank r's part of n elements (the larger parts first)."""
    base, extra = divmod(n, world)
    lo = r * base + min(r, extra)
    return lo, lo + base + (r < extra)


def _tag(kind: str, t: torch.Tensor, op: str, what: str) -> bytes:
    """A round's header: kind, dtype, element count and operation (compared across ranks), then the label."""
    numbers = struct.pack("<4q", KINDS[kind], zlib.crc32(str(t.dtype).encode()), t.numel(), zlib.crc32(op.encode()))
    text = f"{t.numel()} {str(t.dtype).removeprefix('torch.')}|{what or kind}"
    return (numbers + text.encode()[: HEADER - 32]).ljust(HEADER, b"\0")


def _describe(header: bytes) -> str:
    """What a peer's header says it is doing: 'all_reduce at w2 (4096 float32)'."""
    sizes, _, label = header[32:].rstrip(b"\0").decode(errors="replace").partition("|")
    return f"{label} ({sizes})"


def process_alive(pid: int) -> bool:
    """Whether process `pid` (of this host) still runs; a zombie (ended, not yet collected) counts as ended."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has ended
    except (OSError, IndexError):
        return True
