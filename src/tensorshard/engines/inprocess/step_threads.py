"""The threads that run a parallel decode step's shards (parallel_step.py), woken once per token.

    threads = StepThreads(world=2, labels=["cpu[0]", "cpu[1]"], name="tensorshard-step", setup=None)
    value = threads.run(work, abort=step.abort, timeout=310.0)   # work(0) here, work(r) in thread r; returns work(0)
    threads.close()

A token of a small model takes a few milliseconds, so what surrounds the shards' graphs counts. The engine's call
(engine.py `run_modules`, workers.py) serves every kind of call: it copies the inputs to every device, carries the
caller's grad mode, inference mode and autocast into each shard's thread, opens a rendezvous for the Python
collectives, makes a task per shard and joins the outputs. A parallel decode step whose collectives are all native
needs none of that per token: its inputs are already each shard's own (stitched_decode.py), its graphs were
compiled for the call's autocast and call no Python collective, and only rank 0's output is returned. Here each
rank r > 0 has a thread of its own, parked on a lock of its own; a call hands it the work, releases that lock
(one futex wake), runs rank 0 in the caller's thread and waits on each thread's "done" lock (the GIL released
while it waits). `setup(rank)`, if given, runs once in each thread before its first work (a parallel step sets
the thread's native rank there, not per token). A thread keeps no grad mode (set off once: the stitcher runs only no-gradient calls) and takes
the caller's inference mode per call (a cache made under `torch.inference_mode` may only be written inside it).

A shard that raises aborts the others (`abort(rank, error)`: a native group fails its ranks' waits at once); the
call waits for every thread (at most `timeout` seconds, `ABORT_GRACE` after a failure) and raises the first error
that is not the others' abort, with a note naming the device, as workers.py does. A thread that does not come
back in time is abandoned and the threads are marked broken (`broken`): the caller drops the step.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch

from .workers import set_thread_count
ABORT_GRACE = 5.0  # seconds the other shards get to stop once one has failed


class _Seat:
    """One thread's mailbox: its work for the call, its result, and the two locks of the hand-off."""

    __slots__ = ("go", "done", "work", "abort", "inference", "error", "stop")

    def __init__(self) -> None:
        self.go, self.done = threading.Lock(), threading.Lock()
        self.go.acquire()  # held: the thread waits on it
        self.done.acquire()  # held: the caller waits on it
        self.work: Callable[[int], Any] | None = None
        self.abort: Callable[[int, BaseException], None] | None = None
        self.inference = False
        self.error: BaseException | None = None
        self.stop = False


class StepThreads:
    """One parked thread per rank r > 0 (rank 0 runs in the caller's thread), started on first use."""

    def __init__(self, world: int, labels: Sequence[str], name: str = "tensorshard-step",
                 setup: Callable[[int], None] | None = None) -> None:
        self.world, self.labels, self.name, self.setup = world, list(labels), name, setup
        self._seats: list[_Seat] = []
        self.broken = False  # a thread was abandoned (stuck): this object must not run another call
        self._finalizer = weakref.finalize(self, _stop, self._seats)

    def _start(self) -> None:
        for rank in range(1, self.world):
            seat = _Seat()
            threading.Thread(target=_loop, args=(seat, rank, self.setup), name=f"{self.name}-{rank}", daemon=True).start()
            self._seats.append(seat)

    def run(self, work: Callable[[int], Any], *, abort: Callable[[int, BaseException], None], timeout: float) -> Any:
        """`work(rank)` for every rank at once, rank 0 in this thread: rank 0's value, or the first error."""
        if self.broken:
            raise RuntimeError("a shard's thread of this decode step was abandoned (stuck): the step is dropped")
        if not self._seats:
            self._start()
        inference = torch.is_inference_mode_enabled()
        for seat in self._seats:
            seat.work, seat.abort, seat.inference, seat.error = work, abort, inference, None
            seat.go.release()
        errors: dict[int, BaseException] = {}
        value = None
        try:
            value = work(0)
        except BaseException as error:  # (KeyboardInterrupt too: the others are stopped before it is raised)
            errors[0] = error
            abort(0, error)
        deadline = time.monotonic() + (ABORT_GRACE if errors else timeout)
        for rank, seat in enumerate(self._seats, start=1):
            while True:
                try:
                    came = seat.done.acquire(timeout=max(0.0, deadline - time.monotonic()))
                    break
                except BaseException as error:  # KeyboardInterrupt while waiting: stop the others, keep waiting
                    errors.setdefault(0, error)
                    abort(0, error)
                    deadline = min(deadline, time.monotonic() + ABORT_GRACE)
            if not came:
                self.broken = True
                errors[rank] = TimeoutError(
                    f"the shard on {self.labels[rank]} (rank {rank}) did not finish its decode step in time: its "
                    "thread was abandoned")
                abort(rank, errors[rank])
            elif seat.error is not None:
                if not errors:
                    deadline = min(deadline, time.monotonic() + ABORT_GRACE)
                errors[rank] = seat.error
            seat.work, seat.abort, seat.error = None, None, None
        if errors:
            raise _first(errors, self.labels)
        return value

    def close(self) -> None:
        """Stop the parked threads (a thread in the middle of a call stops once it is done)."""
        self._finalizer()


def _first(errors: dict[int, BaseException], labels: Sequence[str]) -> BaseException:
    """The error to raise: a shard's own failure before another's report that the group was aborted."""
    rank = next((r for r, e in sorted(errors.items()) if "failed on rank" not in str(e)), min(errors))
    error = errors[rank]
    if hasattr(error, "add_note"):
        error.add_note(f"raised in the tensor-parallel shard on {labels[rank]} (rank {rank}) of a parallel decode step")
    return error


def _loop(seat: _Seat, rank: int, setup: Callable[[int], None] | None) -> None:
    torch.set_grad_enabled(False)  # (thread-local) the parallel step serves no-gradient calls only
    set_thread_count()
    first = setup is not None
    while True:
        seat.go.acquire()
        if seat.stop:
            return
        try:  # (rank r's output is not used: dropped here, not in the caller's thread)
            if first:  # (in the first call: a failure is the call's, reported as any other)
                first = False
                setup(rank)
            if seat.inference:
                with torch.inference_mode():
                    seat.work(rank)
            else:
                seat.work(rank)
        except BaseException as error:
            seat.error = error
            try:
                seat.abort(rank, error)  # the other shards may be waiting for this one in a native collective
            except BaseException as also:
                error.add_note(f"(stopping the other shards failed too: {type(also).__name__}: {also})")
        finally:
            seat.done.release()


def _stop(seats: list[_Seat]) -> None:
    for seat in seats:
        seat.stop = True
        try:
            seat.go.release()
        except RuntimeError:  # (already released: the thread sees `stop` when it next waits)
            pass
    seats.clear()
