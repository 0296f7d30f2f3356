"""Whether a call's shards run at the same time or one at a time: chosen by measuring both, per kind of call.

Shards run in threads of one process, and Python holds one lock (the GIL) that PyTorch releases inside every
operator. When a call is mostly arithmetic (training, a prefill), the shards' kernels overlap and the call gets
faster with the devices. When it is mostly Python (decoding a token: each operator takes microseconds), the
shards' Python cannot overlap anyway, and running them at the same time only makes the threads hand the lock
back and forth at every operator: measured here, a small Llama's token at 8 CPU slots took 112 ms in threads
and 56 ms with the shards one after another. Which case a call is depends on the model, the batch, the
devices and the machine, so the engine measures it:

- calls are grouped by `call_key`: grad mode, and the shapes of the tensor inputs, each size rounded up to a
  power of two (a decoding step's growing attention mask keeps its key for many tokens);
- a call whose shards ran at the same time for more than `BUSY` seconds per shard between two collectives on
  average (its wall time over its collectives and over its shards: Python-bound shards hold the GIL in turns,
  so such a call's wall time grows with their number) is arithmetic-bound (a decoding step of a small model
  spends a fraction of a millisecond there): its kind keeps the shards together, untried one at a time;
- a new key that differs from a known one only in the last size of one input (a decoding step whose attention
  mask grew past a power of two) starts from that key's timings, untried again until its next retiming (probed
  anew, the slower way would cost a 32-token decoding run one or two slow steps per power of two: at 8 slots,
  where it is ~2x slower, ~5% per token);
- otherwise the first calls of a key alternate between the two ways (`PROBES` each, or one each where one way
  was `CLEAR` times faster), then every call takes the faster one (the lower median of its timings); every `REPROBE` calls the other way is timed once more, so a change
  (a longer cache, a busier machine) is followed.

Only calls without gradients are scheduled this way (inference and decoding); a call that builds a graph runs
its shards at the same time, as its backward pass will. The choice changes no number: the shards run the same
operators and every collective combines their tensors in rank order, whichever shard arrives last.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Hashable

import torch
from torch.utils._pytree import tree_flatten

PROBES = 2  # timed calls of each way before choosing ...
CLEAR = 1.25  # ... unless after one each, one way was this many times faster
BUSY = 0.005  # seconds between two collectives (on average) above which a call is arithmetic-bound
REPROBE = 64  # calls between two timings of the way not chosen
KEEP = 8  # timings kept per way and key
MAX_KEYS = 64  # kinds of call remembered per model


def call_key(args: tuple, kwargs: dict) -> Hashable:
    """The kind of a call: grad mode, and its tensor inputs' shapes with every size rounded up to a power of two."""
    leaves, _ = tree_flatten((args, kwargs))
    shapes = tuple(tuple(1 << max(0, n - 1).bit_length() for n in x.shape) for x in leaves if isinstance(x, torch.Tensor))
    return torch.is_grad_enabled(), shapes


@dataclass
class Timing:
    """One scheduled call: its kind, the way it runs, when it started."""

    key: Hashable
    serial: bool
    started: float


class Schedule:
    """Per kind of call, the timings of each way and the one chosen (see the module docstring)."""

    def __init__(self) -> None:
        self._kinds: dict[Hashable, dict[str, Any]] = {}

    # Left out of torch.compile's graphs (one graph break each): traced, the bookkeeping's changing state became
    # guards that failed at every call.
    @torch.compiler.disable
    def begin(self, args: tuple, kwargs: dict) -> Timing | None:
        """The way a forward call with these inputs runs (None: at the same time, untimed: it builds a graph)."""
        if torch.is_grad_enabled():
            return None
        key = call_key(args, kwargs)
        return Timing(key, self.serial(key), time.perf_counter())

    @torch.compiler.disable
    def end(self, timing: Timing, collectives: int, shards: int = 1) -> None:
        """Record the call's time; `collectives`: how many it ran, `shards`: over how many shards."""
        seconds = time.perf_counter() - timing.started
        self.record(timing.key, timing.serial, seconds)
        kind = self._kinds.get(timing.key)
        # Divided by the shards: at 8 CPU slots a small Llama's decoding step took 134 ms for 17 collectives,
        # 7.4 ms between two, all of it Python taking turns; unscaled, that read as arithmetic, and its kind was
        # never tried one shard at a time (the faster way there).
        if kind is not None and not timing.serial and seconds > BUSY * (collectives + 1) * shards:
            kind["arithmetic"] = True  # no need to try it one shard at a time

    def serial(self, key: Hashable) -> bool:
        """Whether the next call of this kind runs its shards one at a time."""
        if key[0]:  # builds a graph: the shards at the same time, as in backward
            return False
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._new_kind(key)
        kind["calls"] += 1
        if kind.get("arithmetic"):
            return False
        together, serial = kind["together"], kind["serial"]
        if not _decided(together, serial):
            return len(serial) < len(together)  # alternate: together first
        best_serial = statistics.median(serial) < statistics.median(together)
        if kind["calls"] % REPROBE == 0:
            return not best_serial
        return best_serial

    def _new_kind(self, key: Hashable) -> dict[str, Any]:
        """A kind's state, started from the timings of the kind it grew out of, if any (the module docstring)."""
        kind = {"together": deque(maxlen=KEEP), "serial": deque(maxlen=KEEP), "calls": 0}
        grew_from = next((self._kinds[k] for k in reversed(self._kinds) if _grown(k, key)), None)
        if grew_from is not None:
            kind["together"].extend(grew_from["together"])
            kind["serial"].extend(grew_from["serial"])
            if grew_from.get("arithmetic"):
                kind["arithmetic"] = True
        if len(self._kinds) >= MAX_KEYS:
            self._kinds.pop(next(iter(self._kinds)))
        self._kinds[key] = kind
        return kind

    def record(self, key: Hashable, serial: bool, seconds: float) -> None:
        kind = self._kinds.get(key)
        if kind is not None:
            kind["serial" if serial else "together"].append(seconds)

    def chosen(self, key: Hashable) -> str | None:
        """"serial" or "together" once both were timed for this kind of call (None before): for tests and logs."""
        kind = self._kinds.get(key)
        if kind is not None and kind.get("arithmetic"):
            return "together"
        if kind is None or not _decided(kind["together"], kind["serial"]):
            return None
        return "serial" if statistics.median(kind["serial"]) < statistics.median(kind["together"]) else "together"


def _grown(old: Hashable, new: Hashable) -> bool:
    """`new` is `old` with the last size of one input changed, everything else alike (grad mode, every other shape)."""
    if old[0] != new[0] or len(old[1]) != len(new[1]):
        return False
    differ = [(a, b) for a, b in zip(old[1], new[1]) if a != b]
    return len(differ) == 1 and len(differ[0][0]) == len(differ[0][1]) > 0 and differ[0][0][:-1] == differ[0][1][:-1]


def _decided(together: deque, serial: deque) -> bool:
    """Both ways timed `PROBES` times, or once each with one of them `CLEAR` times faster."""
    if not together or not serial:
        return False
    if len(together) >= PROBES and len(serial) >= PROBES:
        return True
    a, b = together[0], serial[0]
    return max(a, b) >= CLEAR * min(a, b)
