"""Counting collectives: `with tp.count_collectives() as c: ...` then `c.counts`, `c.bytes`.

Every collective that tensorshard runs (in either engine) is reported here once, not once per device,
with the bytes of the tensor each device ends up with, and whether it ran in the forward or the backward
pass. Transfers at the engine's boundary (copying the inputs to every device, returning the output) are
not collectives between shards and are not counted.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

_lock = threading.Lock()
_active: list["CollectiveCounter"] = []


@dataclass
class CollectiveCounter:
    """Collectives seen while the context was open."""

    forward: Counter = field(default_factory=Counter)  # kind -> count, forward pass
    backward: Counter = field(default_factory=Counter)  # kind -> count, backward pass
    forward_bytes: int = 0
    backward_bytes: int = 0
    log: list[tuple[str, str, int, str]] = field(default_factory=list)  # (phase, kind, bytes, where)

    @property
    def counts(self) -> dict[str, int]:
        """Collectives by kind, forward and backward together, e.g. {"all_reduce": 2}."""
        return dict(self.forward + self.backward)

    @property
    def bytes(self) -> int:
        """Bytes of all collectives' results, per device, forward and backward together."""
        return self.forward_bytes + self.backward_bytes

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
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)
