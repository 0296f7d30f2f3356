"""Counting collectives: `with tp.count_collectives() as c: ...` then `c.counts`, `c.bytes`.

Every collective that tensorshard runs (in either engine) is reported here once, not once per device,
with the bytes of the tensor each device ends up with, and whether it ran in the forward or the backward
pass. Transfers at the engine's boundary (copying the inputs to every device, returning the output) are
not collectives between shards and are not counted.

The native collectives (comm/native/, C++ operators that compiled graphs call without Python) keep their own log
in C++ while a counter is open; a counter reads it when it closes and when `counts` or `bytes` is read, so
their entries follow the Python-side ones of the same block in `log`.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Protocol

from .native.ops import when_loaded

_lock = threading.Lock()
_active: list["CollectiveCounter"] = []
_native = None  # the native collectives' log (comm/native/ops.py), once they are loaded


class NativeLog(Protocol):
    def start(self) -> int: ...  # begin logging; the position to read from

    def read(self, since: int) -> tuple[int, list[tuple[str, int, str]]]: ...  # (new position, (kind, bytes, where))

    def stop(self) -> None: ...


@dataclass
class CollectiveCounter:
    """Collectives seen while the context was open."""

    forward: Counter = field(default_factory=Counter)  # kind -> count, forward pass
    backward: Counter = field(default_factory=Counter)  # kind -> count, backward pass
    forward_bytes: int = 0
    backward_bytes: int = 0
    log: list[tuple[str, str, int, str]] = field(default_factory=list)  # (phase, kind, bytes, where)
    _native_at: int | None = field(default=None, repr=False)  # position in the native log, while reading it

    @property
    def counts(self) -> dict[str, int]:
        """Collectives by kind, forward and backward together, e.g. {"all_reduce": 2}."""
        self._read_native()
        return dict(self.forward + self.backward)

    @property
    def bytes(self) -> int:
        """Bytes of all collectives' results, per device, forward and backward together."""
        self._read_native()
        return self.forward_bytes + self.backward_bytes

    def _read_native(self) -> None:
        """Add the native collectives logged since the last read (they run forward only: no autograd)."""
        if self._native_at is None or _native is None:
            return
        with _lock:
            self._native_at, entries = _native.read(self._native_at)
            for kind, nbytes, where in entries:
                self._add(kind, nbytes, "forward", where)

    def _add(self, kind: str, nbytes: int, phase: str, where: str) -> None:
        if phase == "backward":
            self.backward[kind] += 1
            self.backward_bytes += nbytes
        else:
            self.forward[kind] += 1
            self.forward_bytes += nbytes
        self.log.append((phase, kind, nbytes, where))


def record(kind: str, nbytes: int, phase: str, where: str = "") -> None:
    """Report one collective to every open counter."""
    if not _active:
        return
    with _lock:
        for counter in _active:
            counter._add(kind, nbytes, phase, where)


@contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Count the collectives tensorshard runs inside the block (all threads of this process)."""
    counter = CollectiveCounter()
    with _lock:
        _active.append(counter)
        if _native is not None:
            counter._native_at = _native.start()
    try:
        yield counter
    finally:
        counter._read_native()
        with _lock:
            _active.remove(counter)
            if counter._native_at is not None:
                counter._native_at = None
                _native.stop()


def _attach_native(log: NativeLog) -> None:
    """The native collectives were loaded: counters open now and later read their log too."""
    global _native
    with _lock:
        _native = log
        for counter in _active:
            counter._native_at = log.start()


when_loaded(_attach_native)
