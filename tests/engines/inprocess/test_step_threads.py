"""The threads of a parallel decode step (engines/inprocess/step_threads.py), with plain Python work: each rank on a
thread of its own at the same time, the caller's inference mode carried, failures stopping the others."""

from __future__ import annotations

import threading

import pytest
import torch

from tensorshard.engines.inprocess.step_threads import StepThreads

pytestmark = pytest.mark.timeout(60)


def test_every_rank_runs_on_its_own_thread_at_the_same_time_and_rank_0_in_the_callers():
    """Three ranks meet at a barrier inside their work (ranks run one after another would break it), twice: the
    parked threads serve the next call; rank 0's value is returned; no grad mode in the threads, the caller's
    inference mode in all of them."""
    threads = StepThreads(3, ["cpu[0]", "cpu[1]", "cpu[2]"])
    barrier = threading.Barrier(3, timeout=10)
    seen: dict[int, tuple] = {}

    def work(rank):
        barrier.wait()
        seen[rank] = (threading.get_ident(), torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        return f"rank {rank}"

    with torch.inference_mode():
        assert threads.run(work, abort=lambda rank, error: None, timeout=10) == "rank 0"
    assert seen[0][0] == threading.get_ident() and len({seen[r][0] for r in range(3)}) == 3, seen
    assert [seen[r][2] for r in range(3)] == [True] * 3 and not seen[1][1] and not seen[2][1], seen
    first = {r: seen[r][0] for r in range(3)}
    seen.clear()
    assert threads.run(work, abort=lambda rank, error: None, timeout=10) == "rank 0"
    assert {r: seen[r][0] for r in range(3)} == first and not seen[1][2], seen  # the same threads; inference off
    threads.close()


def test_a_failing_rank_stops_the_others_and_its_error_is_raised_naming_its_device():
    """Rank 1 raises: `abort` is called for it (a native group's waits raise then: here rank 0 waits for the abort),
    the call raises rank 1's error (not rank 0's report of the abort), noted with the device; the threads serve
    the next call."""
    threads = StepThreads(2, ["cpu[0]", "cpu[1]"])
    aborted = threading.Event()
    calls = []

    def abort(rank, error):
        calls.append((rank, str(error)))
        aborted.set()

    def work(rank):
        if rank == 1:
            raise ValueError("shard 1 broke")
        assert aborted.wait(10)
        raise RuntimeError("the group failed on rank 1 before (shard 1 broke)")

    with pytest.raises(ValueError, match="shard 1 broke") as info:
        threads.run(work, abort=abort, timeout=10)
    assert calls[0] == (1, "shard 1 broke"), calls
    assert any("cpu[1] (rank 1)" in note for note in getattr(info.value, "__notes__", [])), info.value
    aborted.clear()
    assert threads.run(lambda rank: rank, abort=abort, timeout=10) == 0
    threads.close()


def test_a_rank_that_does_not_come_back_in_time_is_abandoned_and_the_threads_refuse_later_calls():
    threads = StepThreads(2, ["cpu[0]", "cpu[1]"])
    release = threading.Event()
    aborted = []
    with pytest.raises(TimeoutError, match="cpu\\[1\\] \\(rank 1\\) did not finish"):
        threads.run(lambda rank: release.wait(10) if rank == 1 else None, abort=lambda r, e: aborted.append(r), timeout=0.2)
    assert threads.broken and aborted == [1]
    with pytest.raises(RuntimeError, match="abandoned"):
        threads.run(lambda rank: None, abort=lambda r, e: None, timeout=1)
    release.set()
    threads.close()


def test_close_stops_the_parked_threads():
    threads = StepThreads(3, ["a", "b", "c"], name="step-threads-close-test")
    threads.run(lambda rank: None, abort=lambda r, e: None, timeout=10)
    mine = [t for t in threading.enumerate() if t.name.startswith("step-threads-close-test")]
    assert len(mine) == 2
    threads.close()
    for t in mine:
        t.join(5)
    assert not any(t.is_alive() for t in mine)


def _openmp():
    """torch's own GNU OpenMP runtime, where torch's parallel backend is OpenMP with libgomp; else None."""
    import ctypes
    import glob
    import os

    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    found = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))
    return ctypes.CDLL(found[0]) if found else None


@pytest.mark.parametrize("kind", ["step threads", "workers"])
def test_a_shards_thread_takes_torchs_intra_op_thread_count_before_any_work(kind):
    """OpenMP's thread count is per thread and a new thread starts with one per core: a shard's thread whose first
    work is a compiled graph calling the BLAS directly would run an OpenMP team of one thread per core, and the
    process's other OpenMP teams would slow down (engines/inprocess/workers.py `set_thread_count`). The count is
    read with OpenMP's own call, which does not set it the way asking torch does."""
    openmp = _openmp()
    if openmp is None:
        pytest.skip("torch here does not run its parallel loops on GNU OpenMP")
    from tensorshard.engines.inprocess.workers import WorkerPool

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seen = {}

        def work(rank):
            seen[rank] = openmp.omp_get_max_threads()

        if kind == "step threads":
            threads = StepThreads(2, ["cpu[0]", "cpu[1]"])
            threads.run(work, abort=lambda rank, error: None, timeout=10)
            threads.close()
        else:
            pool = WorkerPool()
            pool.run([lambda: work(0), lambda: work(1)], labels=["cpu[0]", "cpu[1]"],
                     on_error=lambda error, index: None, timeout=10)
            pool.close()
    finally:
        torch.set_num_threads(previous)
    assert seen == {0: 1, 1: 1}, seen
