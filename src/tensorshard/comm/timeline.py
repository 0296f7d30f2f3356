"""Where the in-process engine's shards spend a step: `with tp.shard_timeline() as t: ...` then `t.summary()`.

While the block runs, every call of an in-process split model (a forward call, a backward pass, an optimizer
step) records when each shard started and returned and when it waited at a collective for the others. From
that, `summary()` tells how the wall time splits:

    busy        each shard's time running (its own Python and kernels, or waiting for the GIL or a core)
    waiting     each shard's time blocked at a collective until the last shard arrived
    done early  each shard's time between returning and the end of the call (the call waits for the slowest)
    one running the time during which exactly one shard was busy, plus the time outside every call (the
                caller's own code: the loss, `generate`'s token choice): what does not get faster with devices

Nothing is recorded, and nothing costs, while no timeline is open. Used by benchmarks/scaling.py.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

_lock = threading.Lock()
_active: list["ShardTimeline"] = []


@dataclass
class ShardTimeline:
    """Intervals recorded while the context was open (`time.perf_counter()` seconds)."""

    start: float = 0.0
    stop: float = 0.0
    calls: list[tuple[str, float, float]] = field(default_factory=list)  # (kind, begin, end)
    shards: list[tuple[int, float, float]] = field(default_factory=list)  # (rank, start, return)
    waits: list[tuple[int, float, float]] = field(default_factory=list)  # (rank, blocked, released)

    def summary(self) -> dict[str, float | int | list[float]]:
        """Seconds, summed over the block: see the module docstring. Per-rank lists are in rank order."""
        wall = (self.stop or time.perf_counter()) - self.start
        ranks = 1 + max((r for r, _, _ in self.shards), default=0)
        busy_at: list[list[tuple[float, float]]] = [[] for _ in range(ranks)]
        waited = [0.0] * ranks
        waits_of: list[list[tuple[float, float]]] = [[] for _ in range(ranks)]
        for rank, a, b in self.waits:
            waits_of[rank].append((a, b))
            waited[rank] += b - a
        for rank, a, b in self.shards:
            cursor = a
            for w0, w1 in sorted(w for w in waits_of[rank] if a <= w[0] < b):
                busy_at[rank].append((cursor, w0))
                cursor = w1
            busy_at[rank].append((cursor, b))
        in_calls = _union([(a, b) for _, a, b in self.calls])
        done_early = [0.0] * ranks
        for _, c0, c1 in self.calls:
            for rank, a, b in self.shards:
                if c0 <= a and b <= c1:
                    done_early[rank] += c1 - b
        return {
            "wall": wall,
            "calls": len(self.calls),
            "busy": [sum(b - a for a, b in spans) for spans in busy_at],
            "waiting": waited,
            "done_early": done_early,
            "outside_calls": max(0.0, wall - in_calls),
            "one_running": max(0.0, wall - in_calls) + _exactly_one([s for spans in busy_at for s in spans]),
        }

    def _add(self, kind: str, *entry) -> None:
        getattr(self, kind).append(entry)


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _exactly_one(spans: list[tuple[float, float]]) -> float:
    """Time covered by exactly one of `spans`."""
    events = sorted([(a, 1) for a, b in spans if b > a] + [(b, -1) for a, b in spans if b > a])
    total, depth, last = 0.0, 0, 0.0
    for t, step in events:
        if depth == 1:
            total += t - last
        depth += step
        last = t
    return total


def recording() -> bool:
    """Whether a timeline is open (the engine records only then)."""
    return bool(_active)


def record(kind: str, *entry) -> None:
    """Add an interval to every open timeline: ("calls", kind, begin, end), ("shards", rank, start, end) or
    ("waits", rank, blocked, released)."""
    with _lock:
        for timeline in _active:
            timeline._add(kind, *entry)


@contextmanager
def shard_timeline() -> Iterator[ShardTimeline]:
    """Record the in-process engine's shard intervals inside the block (all models of this process)."""
    timeline = ShardTimeline(start=time.perf_counter())
    with _lock:
        _active.append(timeline)
    try:
        yield timeline
    finally:
        timeline.stop = time.perf_counter()
        with _lock:
            _active.remove(timeline)
