"""Worker threads of the in-process engine: one per device, the caller's thread state carried over.

The caller's thread runs shard 0 itself; shards 1..N-1 run in persistent worker threads (PyTorch
releases the GIL inside its kernels, so the shards' matrix products overlap). Grad mode, inference mode
and autocast are thread-local in PyTorch; `ThreadState` copies them from the caller into every worker.

A shard that raises aborts the others' collectives (see comm/threads.py); `run` waits until every shard
has finished, so no thread is left waiting, then re-raises the first real error with a note naming the
device. A shard that never comes back within the timeout is reported and its thread is replaced.
"""

from __future__ import annotations

import queue
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from ..comm.threads import CollectiveAborted


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
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device_type, enabled, dtype, cache in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
            yield


class _Task:
    __slots__ = ("fn", "done", "value", "error")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.done, self.value, self.error = fn, threading.Event(), None, None


class WorkerPool:
    """Persistent worker threads; `run(fns)` runs fns[0] in the caller and fns[i] in worker i."""

    def __init__(self, name: str = "tensorshard") -> None:
        self.name = name
        self._queues: dict[int, queue.SimpleQueue] = {}
        self._threads: dict[int, threading.Thread] = {}

    def _worker(self, index: int) -> queue.SimpleQueue:
        thread = self._threads.get(index)
        if thread is None or not thread.is_alive():
            q: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=_loop, args=(q,), name=f"{self.name}-{index}", daemon=True)
            thread.start()
            self._queues[index], self._threads[index] = q, thread
        return self._queues[index]

    def _forget(self, index: int) -> None:
        """Drop a worker that is stuck; the next call starts a fresh thread."""
        self._threads.pop(index, None)
        self._queues.pop(index, None)

    def run(
        self,
        fns: Sequence[Callable[[], Any]],
        *,
        labels: Sequence[str],
        on_error: Callable[[BaseException, int], None],
        timeout: float,
    ) -> list[Any]:
        tasks = [_Task(fn) for fn in fns]
        for index, task in enumerate(tasks[1:], start=1):
            self._worker(index).put(task)
        _execute(tasks[0])
        if tasks[0].error is not None:
            on_error(tasks[0].error, 0)
        for index, task in enumerate(tasks[1:], start=1):
            try:
                finished = task.done.wait(timeout)
            except BaseException as e:  # e.g. KeyboardInterrupt while waiting
                on_error(e, 0)
                for other in tasks[1:]:
                    other.done.wait(timeout)
                raise
            if not finished:
                task.error = TimeoutError(
                    f"the shard on {labels[index]} did not finish within {timeout:g} s; it is stuck outside "
                    "tensorshard's collectives (in the model's own code?)"
                )
                self._forget(index)
            if task.error is not None:
                on_error(task.error, index)
        errors = [(i, t.error) for i, t in enumerate(tasks) if t.error is not None]
        if errors:
            # Report the shard that failed first, not the ones that stopped because of it.
            index, error = next(((i, e) for i, e in errors if not isinstance(e, CollectiveAborted)), errors[0])
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
        task.done.set()


def _loop(q: queue.SimpleQueue) -> None:
    while True:
        _execute(q.get())
