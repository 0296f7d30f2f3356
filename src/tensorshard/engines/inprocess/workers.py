"""Worker threads of the in-process engine: one per device, the caller's thread state carried over.

The caller's thread runs one shard itself (shard 0, unless told otherwise); the others run in persistent
worker threads, worker i for shard i (PyTorch releases the GIL inside its kernels, so the shards' matrix
products overlap). Grad mode, inference mode
and autocast are thread-local in PyTorch; `ThreadState` copies them from the caller into every worker.
Saved-tensor hooks are thread-local too, but no shard gets the caller's: a non-reentrant checkpoint around
the whole split model would otherwise recompute the whole call from inside one shard's backward pass (a
shard's own checkpointed blocks push their hooks inside the shard, as usual).

A shard that raises aborts the others' collectives (see comm/threads.py); `run` then waits for every
shard to stop, so none is left running the failed call, and re-raises the error that came first, with a
note naming the device. The wait is bounded: a worker still running `timeout` seconds after shard 0
returned, or `grace` seconds after a shard failed, is reported stuck and abandoned (its thread exits
when it comes back; the next call starts a fresh one). After a KeyboardInterrupt the others get
`INTERRUPT_GRACE` seconds. Worker threads end when their pool is garbage-collected or closed.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from ...comm.threads import CollectiveAborted


@dataclass(frozen=True)
class ThreadState:
    """The thread-local PyTorch state of the caller that its shards must share."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, bool, torch.dtype, bool], ...]  # (device type, enabled, dtype, cache)

    @classmethod
    def capture(cls) -> "ThreadState":
        casts = []
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                casts.append((device_type, True, torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled()))
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), tuple(casts))

    @contextmanager
    def applied(self, device: torch.device) -> Iterator[None]:
        with ExitStack() as stack:
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
            if _saved_tensor_hooks() is not None:  # the caller's, in the shard that runs in its thread
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_same, _same))
            if self.inference and not torch.is_inference_mode_enabled():  # (the caller's thread is already)
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))  # (also restores it, should the model not)
            for device_type, enabled, dtype, cache in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
            yield


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@torch.compiler.disable  # a builtin dynamo cannot trace: one clean graph break, not a warning
def _saved_tensor_hooks():
    """The innermost saved-tensor hooks of this thread (or a guess that there are some, if PyTorch cannot say)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else (_same, _same)


ABORT_GRACE = 5.0  # seconds (at most) the other shards get to stop once one has failed
INTERRUPT_GRACE = 2.0  # ... after a KeyboardInterrupt in the caller
_POLL = 0.1  # seconds between checks for a failure while waiting for a worker


class _Task:
    """One shard's work for one call. `done` is a lock held until the task has run: waiting for it is one
    `acquire` (a `threading.Event` costs a Condition, and a fresh lock per wait, on every call of the model)."""

    __slots__ = ("fn", "done", "finished", "value", "error")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.value, self.error, self.finished = fn, None, None, False
        self.done = threading.Lock()
        self.done.acquire()

    def wait(self, timeout: float) -> bool:
        """Whether the task has run, waiting at most `timeout` seconds for it (the caller's thread only)."""
        if not self.finished and self.done.acquire(timeout=timeout):
            self.done.release()  # (left free: a later wait returns at once)
        return self.finished


class WorkerPool:
    """Persistent worker threads; `run(fns)` runs fns[inline] (fns[0]) in the caller and fns[i] in worker i."""

    def __init__(self, name: str = "tensorshard") -> None:
        self.name = name
        self._queues: dict[int, queue.SimpleQueue] = {}
        self._threads: dict[int, threading.Thread] = {}
        # The threads hold only their queues, so the pool can be collected; then they are told to stop.
        self._finalizer = weakref.finalize(self, _stop_all, self._queues)

    def close(self) -> None:
        """Stop the idle worker threads (a later `run` starts new ones)."""
        _stop_all(self._queues)
        self._threads.clear()

    def _worker(self, index: int) -> queue.SimpleQueue:
        thread = self._threads.get(index)
        if thread is None or not thread.is_alive():
            q: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=_loop, args=(q,), name=f"{self.name}-{index}", daemon=True)
            thread.start()
            self._queues[index], self._threads[index] = q, thread
        return self._queues[index]

    def _forget(self, index: int) -> None:
        """Drop a worker that is stuck: it exits once it returns; the next call starts a fresh thread."""
        self._threads.pop(index, None)
        q = self._queues.pop(index, None)
        if q is not None:
            q.put(None)

    def run(
        self,
        fns: Sequence[Callable[[], Any]],
        *,
        labels: Sequence[str],
        on_error: Callable[[BaseException, int], None],
        timeout: float,
        first_error: Callable[[], BaseException | None] = lambda: None,
        grace: float = ABORT_GRACE,
        inline: int = 0,
    ) -> list[Any]:
        """Run the shards; return their values, or raise the error that came first (`first_error()` if
        it is one of theirs, else the first that is not a `CollectiveAborted`).

        Waits at most `timeout` seconds for the workers after the caller's shard returns, and at most `grace`
        once a shard has failed (`INTERRUPT_GRACE` after a KeyboardInterrupt).
        """
        tasks = [_Task(fn) for fn in fns]
        others = [(index, task) for index, task in enumerate(tasks) if index != inline]
        for index, task in others:
            self._worker(index).put(task)
        _execute(tasks[inline])
        errors: dict[int, BaseException] = {}
        deadline = time.monotonic() + timeout
        interrupted: BaseException | None = None

        def failed(error: BaseException, index: int) -> None:
            nonlocal deadline
            errors[index] = error
            on_error(error, index)
            wait = grace if isinstance(error, Exception) else min(grace, INTERRUPT_GRACE)
            deadline = min(deadline, time.monotonic() + wait)

        if tasks[inline].error is not None:
            failed(tasks[inline].error, inline)
        for index, task in others:
            while True:
                try:
                    if task.wait(max(0.0, min(deadline - time.monotonic(), _POLL))):
                        break
                except BaseException as e:  # KeyboardInterrupt while waiting
                    interrupted = interrupted or e
                    failed(e, inline)
                    continue
                if first_error() is not None:
                    deadline = min(deadline, time.monotonic() + grace)  # a worker failed: stop soon
                if time.monotonic() >= deadline:
                    break
            if not task.finished:
                self._forget(index)
                failed(TimeoutError(
                    f"the shard on {labels[index]} (rank {index}) did not stop in time: it is stuck outside "
                    "tensorshard's collectives (in the model's own code?). Its thread was abandoned."
                ), index)
            elif task.error is not None:
                failed(task.error, index)
        if interrupted is not None:
            raise interrupted
        if errors:
            first = first_error()
            index, error = next(
                ((i, e) for i, e in errors.items() if e is first),
                next(((i, e) for i, e in errors.items() if not isinstance(e, CollectiveAborted)), next(iter(errors.items()))),
            )
            note = f"raised in the tensor-parallel shard on {labels[index]} (rank {index})"
            if hasattr(error, "add_note"):
                error.add_note(note)
                raise error.with_traceback(error.__traceback__)
            raise RuntimeError(f"{note}: {type(error).__name__}: {error}") from error
        return [t.value for t in tasks]


def _execute(task: _Task) -> None:
    try:
        task.value = task.fn()
    except BaseException as e:
        task.error = e
    finally:
        task.fn = None  # drop references to the call's tensors
        task.finished = True
        task.done.release()


def set_thread_count() -> None:
    """Give this new thread torch's intra-op thread count (`torch.set_num_threads`'s), as the first thing it does.

    OpenMP's count is per thread: a new thread starts with one per core, and torch sets its own only when the
    thread first runs one of torch's parallel loops, which a compiled graph may never do (inductor's C++ code calls
    the BLAS directly). The BLAS would then run an OpenMP team of its own in this thread, one thread per core, and
    the process would hold more OpenMP threads than cores; GNU OpenMP then puts idle threads to sleep at once, so
    every later parallel region in the process, the caller's own models included, pays a wake-up (3x slower per
    token for the small Llama of BENCHMARKS.md at 2 threads). Asking torch for the count sets this thread's."""
    torch.get_num_threads()


def _loop(q: queue.SimpleQueue) -> None:
    set_thread_count()
    while True:
        task = q.get()
        if task is None:  # the pool was closed, collected, or gave up on this thread
            return
        _execute(task)
        del task  # do not keep the call's outputs alive until the next call


def _stop_all(queues: dict[int, queue.SimpleQueue]) -> None:
    for q in queues.values():
        q.put(None)
    queues.clear()
