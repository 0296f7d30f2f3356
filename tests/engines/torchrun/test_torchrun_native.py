"""The native collectives between torchrun ranks (comm/native/: C++ operators over the shared-memory segment):
the rank-ordered sums and joined pieces on every rank, counted by `tp.count_collectives()`, ranks at different
collectives, a missing rank and a rank's reported failure stopping the others with a clear error, and no rank
using them when one cannot load them (logged). What generate()'s compiled decode step calls, and its counts, are
asserted in test_torchrun_compile.py. The ops without torchrun (threads, a peer process that ends) are in tests/core/test_native_collectives.py."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.distributed as dist

import tensorshard as tp
from support.helpers import log_messages
from tensorshard.comm import transport
from tensorshard.comm.dist_guard import guard_for
from tensorshard.comm.native import ops as native

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not native.available(), reason=f"native collectives unavailable: {native.why_not()}")]


def _native_group(timeout: float, with_guard: bool = False):
    """A fresh group over every rank, its shared-memory transport and native group: (handle, group rank), and
    its guard `with_guard`."""
    group = dist.new_group(list(range(dist.get_world_size())))
    guard = guard_for(group, timeout)
    transport.connect(guard, "cpu")
    handle = transport.connect_native(guard)
    assert handle is not None and guard.shm is not None
    return (handle, guard.shm.rank, guard) if with_guard else (handle, guard.shm.rank)


def _piece(rank: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)


def sums_and_pieces_task() -> dict:
    handle, rank = _native_group(60)
    world = dist.get_world_size()
    out = {}
    with tp.count_collectives() as counted:
        for dtype in (torch.float32, torch.bfloat16):
            # 1 KiB of fp32 (a decode step's hidden state), and 1.6 MB: several rounds of a 512 KiB slot
            for numel in (256, 400_000):
                x = _piece(rank, (numel,), dtype)
                y = torch.ops.tensorshard.native_all_reduce(x, handle, rank, f"sum {numel}")
                parts = [_piece(r, (numel,), dtype) for r in range(world)]
                expected = parts[0] + parts[1]
                for p in parts[2:]:
                    expected = expected + p  # rank order 0..N-1: the eager collectives' bits
                out[f"sum {dtype} {numel}"] = torch.equal(y, expected) and y.data_ptr() != x.data_ptr()
        sizes = [3 + 2 * r for r in range(world)]  # uneven pieces along dim 1
        x = _piece(rank, (2, sizes[rank], 5000), torch.float32)
        y = torch.ops.tensorshard.native_all_gather(x, handle, rank, 1, sizes, "joined")
        expected = torch.cat([_piece(r, (2, sizes[r], 5000), torch.float32) for r in range(world)], 1)
        out["gather"] = torch.equal(y, expected)
    out["counts"] = counted.counts
    out["where"] = [entry[3] for entry in counted.log]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sums_in_rank_order_and_joins_uneven_pieces_on_every_rank(pool2, pool3, world):
    for out in (pool2 if world == 2 else pool3).run(sums_and_pieces_task):
        assert all(v for k, v in out.items() if k not in ("counts", "where")), out
        assert out["counts"] == {"all_reduce": 4, "all_gather": 1}  # each rank counts its own, as in eager
        assert out["where"] == ["sum 256", "sum 400000", "sum 256", "sum 400000", "joined"]


def different_collectives_task() -> dict:
    handle, rank = _native_group(30)
    began = time.monotonic()
    try:
        torch.ops.tensorshard.native_all_reduce(torch.ones(4 if rank == 0 else 8), handle, rank, f"w{rank + 1}")
    except RuntimeError as e:
        return {"message": str(e), "seconds": time.monotonic() - began}
    return {"message": "finished", "seconds": time.monotonic() - began}


def test_ranks_at_different_collectives_stop_at_once_naming_each_other(pool2):
    first, second = pool2.run(different_collectives_task)
    for rank, out in enumerate((first, second)):
        assert "the ranks are at different collectives" in out["message"], out
        assert "all_reduce 'w1' (4 float32)" in out["message"] and "all_reduce 'w2' (8 float32)" in out["message"]
        assert out["seconds"] < 5  # not the 30 s limit


def missing_rank_task() -> dict:
    """Rank 1 never reaches the collective: rank 0 gives up after the group's limit (2 s) naming rank 1, and
    rank 1's next collective raises at once, naming rank 0's failure (the group is out of step for good)."""
    handle, rank = _native_group(2)
    began = time.monotonic()
    if rank == 1:
        time.sleep(4)
    return _outcome(began, lambda: torch.ops.tensorshard.native_all_reduce(torch.ones(4), handle, rank, "late" if rank else "alone"))


def _outcome(began: float, collective) -> dict:
    """What `collective()` ended with (its error's message, or "finished") and the seconds since `began`."""
    try:
        collective()
    except RuntimeError as e:
        return {"message": str(e), "seconds": time.monotonic() - began}
    return {"message": "finished", "seconds": time.monotonic() - began}


def test_a_missing_rank_times_out_instead_of_hanging(pool2):
    first, second = pool2.run(missing_rank_task)
    assert "rank 0 timed out after 2" in first["message"] and "waiting for rank(s) 1" in first["message"], first
    assert 1.9 < first["seconds"] < 10
    assert "the group failed on rank 0 before" in second["message"], second
    assert second["seconds"] < 6  # its sleep, then at once


def reported_failure_task() -> dict:
    """Rank 1 raises outside any collective and reports it (as generate()'s compiled step does, decoding.py):
    rank 0, waiting in a native collective, stops at once with rank 1's error, not at the 60 s limit."""
    handle, rank, guard = _native_group(60, with_guard=True)
    began = time.monotonic()
    if rank == 1:
        time.sleep(0.5)
        guard.report(ValueError("bad batch on rank 1"), "the compiled decode step")
        return {"message": "reported", "seconds": time.monotonic() - began}
    return _outcome(began, lambda: torch.ops.tensorshard.native_all_reduce(torch.ones(4), handle, rank, "waiting"))


def test_a_failure_reported_by_a_rank_stops_a_peer_waiting_in_a_native_collective(pool2):
    first, _ = pool2.run(reported_failure_task)
    assert "the group failed on rank 1 before (rank 1 raised ValueError: bad batch on rank 1)" in first["message"], first
    assert first["seconds"] < 10


def one_rank_cannot_load_task() -> dict:
    """Rank 1 cannot load the library (as without a compiler): no rank uses the native collectives (compiled
    graphs keep the Python ones everywhere), and rank 0 says why."""
    group = dist.new_group(list(range(dist.get_world_size())))
    guard = guard_for(group, 60)
    transport.connect(guard, "cpu")
    logged, stop = log_messages("tensorshard.comm.transport", logging.WARNING)
    saved = native.available
    if dist.get_rank() == 1:
        native.available = lambda: False
    try:
        handle = transport.connect_native(guard)
    finally:
        native.available = saved
        stop()
    return {"handle": handle, "logged": logged, "shm": guard.shm is not None}


def test_when_a_rank_cannot_load_them_no_rank_uses_them_and_the_reason_is_logged(pool2):
    first, second = pool2.run(one_rank_cannot_load_task)
    assert first["shm"] and second["shm"]
    assert first["handle"] is None and second["handle"] is None
    assert len(first["logged"]) == 1 and "native collectives off: another rank could not load them" in first["logged"][0]
