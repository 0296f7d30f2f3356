"""The native collectives (comm/native/: C++ operators) between threads of this process, and what surrounds
them: rank-ordered sums and joined pieces, counted once per collective, traced into a graph, the GIL released
while a rank waits, a missing rank or an aborted group raising instead of hanging, a peer process that ends, and
the fallback when the library cannot be built. Between torchrun ranks: tests/engines/torchrun/test_torchrun_native.py."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

import tensorshard as tp
from support.helpers import log_messages
from tensorshard.comm.native import library
from tensorshard.comm.native import ops as native

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not native.available(), reason=f"native collectives unavailable: {native.why_not()}")]


def _on_threads(world: int, fn) -> list:
    """fn(rank) in `world` threads at once; their results in rank order (an exception is returned, not raised)."""
    results: list = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except Exception as e:  # noqa: BLE001 - handed to the test
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _piece(rank: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_rank_ordered_sum(world, dtype):
    group = native.ThreadGroup(world, slot=64 << 10)
    numels = (1, 1024, 50_000)  # the last: several rounds of a 64 KiB slot
    with tp.count_collectives() as counted:
        got = _on_threads(world, lambda r: [torch.ops.tensorshard.native_all_reduce(_piece(r, (n,), dtype), group.handle,
                                                                                     r, f"n{n}") for n in numels])
    for i, n in enumerate(numels):
        parts = [_piece(r, (n,), dtype) for r in range(world)]
        expected = parts[0] + parts[1]
        for p in parts[2:]:
            expected = expected + p  # ((x0 + x1) + x2): the eager collectives' order, so their bits
        for r in range(world):
            assert torch.equal(got[r][i], expected), (r, n)
    assert counted.counts == {"all_reduce": 3}  # once per collective, not once per thread
    assert [entry[3] for entry in counted.log] == ["n1", "n1024", "n50000"]
    assert counted.bytes == sum(numels) * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_every_rank_gets_the_pieces_joined_in_rank_order(dim):
    world, group = 3, native.ThreadGroup(3, slot=4096)  # small slots: pieces take several rounds
    sizes = [4, 1, 3]  # uneven

    def shape(r):
        s = [2, 3, 700]
        s[dim] = sizes[r]
        return tuple(s)

    got = _on_threads(world, lambda r: torch.ops.tensorshard.native_all_gather(
        _piece(r, shape(r), torch.float32), group.handle, r, dim, sizes, "g"))
    expected = torch.cat([_piece(r, shape(r), torch.float32) for r in range(world)], dim)
    assert all(torch.equal(g, expected) for g in got)


def test_a_traced_graph_calls_the_native_ops():
    """Traced whole (fullgraph): the ops have shapes for FakeTensor and stay ops of the graph."""
    group, seen = native.ThreadGroup(2), []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(x, rank):
        y = torch.ops.tensorshard.native_all_reduce(x * 2, group.handle, rank, "sum")
        return torch.ops.tensorshard.native_all_gather(y + 1, group.handle, rank, 0, [3, 3], "join")

    compiled = torch.compile(lambda x: step(x, 0), backend=backend, fullgraph=True)  # rank 0 traces; rank 1 eager
    got = _on_threads(2, lambda r: compiled(_piece(0, (3, 4), torch.float32)) if r == 0 else step(_piece(1, (3, 4), torch.float32), 1))
    summed = _piece(0, (3, 4), torch.float32) * 2 + _piece(1, (3, 4), torch.float32) * 2
    assert torch.equal(got[0], torch.cat([summed + 1, summed + 1])) and torch.equal(got[1], got[0])
    assert [s for s in seen if s.startswith("tensorshard.")] == ["tensorshard.native_all_reduce", "tensorshard.native_all_gather"]


def test_rank_minus_one_is_the_rank_the_thread_set():
    """Rank -1: the calling thread's rank in that group, group -1: the group it set last (so that shards of an even
    split run one compiled graph, which names no group); a thread that never set them is told how."""
    group, other = native.ThreadGroup(2), native.ThreadGroup(2)

    def call(rank):
        torch.ops.tensorshard.native_set_thread_rank(group.handle, rank)
        torch.ops.tensorshard.native_set_thread_rank(other.handle, 1 - rank)  # a rank per group
        return [torch.ops.tensorshard.native_all_gather(torch.full((1,), float(rank)), g, -1, 0, [1, 1], "g")
                for g in (group.handle, other.handle, -1)]  # group -1: the one this thread set last (other)

    got = _on_threads(2, call)
    assert all(torch.equal(g[0], torch.tensor([0.0, 1.0])) and torch.equal(g[1], torch.tensor([1.0, 0.0]))
               and torch.equal(g[2], g[1]) for g in got), got
    unset = native.ThreadGroup(2)
    with pytest.raises(RuntimeError, match=r"rank -1 .* never set its rank there \(native_set_thread_rank"):
        torch.ops.tensorshard.native_all_reduce(torch.ones(2), unset.handle, -1, "x")


def test_a_hold_keeps_its_tensors_until_released():
    """native_hold: one more C++ reference to each tensor (what a C++-wrapper graph's inputs need so that freeing
    one never drops the last C++ reference of a Python-owned tensor, which takes the GIL), until released."""
    x, y = torch.ones(3), torch.zeros(2)
    counts = x._use_count(), y._use_count()  # C++ references to each tensor
    hold = torch.ops.tensorshard.native_hold([x, y])
    assert (x._use_count(), y._use_count()) == (counts[0] + 1, counts[1] + 1)
    torch.ops.tensorshard.native_release(hold)
    assert (x._use_count(), y._use_count()) == counts
    torch.ops.tensorshard.native_release(hold)  # again: nothing left to drop
    assert (x._use_count(), y._use_count()) == counts


def test_a_waiting_rank_releases_the_gil():
    """Rank 0 waits while this thread runs Python for 0.3 s before joining as rank 1: were the GIL held while
    waiting, this thread could not run and rank 0 would time out (1.5 s)."""
    group = native.ThreadGroup(2, timeout=1.5)
    result = {}
    t = threading.Thread(target=lambda: result.update(y=torch.ops.tensorshard.native_all_reduce(torch.ones(8), group.handle, 0, "w")))
    t.start()
    until, loops = time.monotonic() + 0.3, 0
    while time.monotonic() < until:
        loops += 1
    mine = torch.ops.tensorshard.native_all_reduce(torch.ones(8), group.handle, 1, "w")
    t.join()
    assert torch.equal(result["y"], torch.full((8,), 2.0)) and torch.equal(mine, result["y"]) and loops > 1000


def test_a_missing_rank_times_out_and_the_group_then_refuses():
    group = native.ThreadGroup(2, timeout=0.5)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 timed out after \S+ s at all_reduce 'alone' waiting for rank\(s\) 1") as raised:
        torch.ops.tensorshard.native_all_reduce(torch.ones(4), group.handle, 0, "alone")
    # the message gives the time it waited: the limit, or more where a loaded machine woke the waiter late
    assert 0.5 <= float(re.search(r"timed out after (\S+) s", str(raised.value)).group(1)) < 5
    assert time.monotonic() - began < 5
    with pytest.raises(RuntimeError, match="the group failed on rank 0 before .*timed out"):
        torch.ops.tensorshard.native_all_reduce(torch.ones(4), group.handle, 1, "late")


def test_an_aborted_group_stops_a_waiting_rank_at_once():
    group = native.ThreadGroup(2, timeout=60)
    out = {}

    def wait() -> None:
        began = time.monotonic()
        try:
            torch.ops.tensorshard.native_all_reduce(torch.ones(4), group.handle, 0, "w")
        except RuntimeError as e:
            out.update(message=str(e), seconds=time.monotonic() - began)

    waiting = threading.Thread(target=wait)
    waiting.start()
    time.sleep(0.2)
    group.abort(1, "shard 1 raised ValueError")
    waiting.join(10)
    assert "the group failed on rank 1 before (shard 1 raised ValueError)" in out["message"]
    assert out["seconds"] < 2


def test_a_peer_process_that_ends_is_seen_before_the_time_limit(tmp_path):
    """A process group's region (here a plain mapped file); rank 1 is a process that ends without joining."""
    import mmap

    nbytes = native.region_bytes(2, 4096)
    path = tmp_path / "segment"
    path.write_bytes(b"\0" * nbytes)
    with open(path, "r+b") as f:
        segment = mmap.mmap(f.fileno(), nbytes)
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    try:
        handle = torch.ops.tensorshard.native_process_group(torch.frombuffer(segment, dtype=torch.uint8).data_ptr(),
                                                           nbytes, 0, 2, 60.0, [os.getpid(), peer.pid])
        began = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"rank 1 \(process {peer.pid}\) ended while rank 0 waited"):
            torch.ops.tensorshard.native_all_reduce(torch.ones(4), handle, 0, "w")
        assert time.monotonic() - began < 10  # not the 60 s limit
        torch.ops.tensorshard.native_group_close(handle)
    finally:
        peer.wait()


def test_bad_calls_raise_before_anything_moves():
    group = native.ThreadGroup(2)
    with pytest.raises(RuntimeError, match="rank 2 is not in a group of 2 ranks"):
        torch.ops.tensorshard.native_all_reduce(torch.ones(4), group.handle, 2, "w")
    with pytest.raises(RuntimeError, match="3 sizes for a group of 2 ranks"):
        torch.ops.tensorshard.native_all_gather(torch.ones(4), group.handle, 0, 0, [4, 4, 4], "w")
    with pytest.raises(RuntimeError, match="rank 0's piece has 4 rows along dim 0, its size says 3"):
        torch.ops.tensorshard.native_all_gather(torch.ones(4), group.handle, 0, 0, [3, 4], "w")
    with pytest.raises(RuntimeError, match="dtype Bool is not supported"):
        torch.ops.tensorshard.native_all_reduce(torch.ones(4, dtype=torch.bool), group.handle, 0, "w")
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        native.ThreadGroup(0)
    group.close()
    with pytest.raises(RuntimeError, match=f"no group {group.handle} in this process"):
        torch.ops.tensorshard.native_all_reduce(torch.ones(4), group.handle, 0, "w")


def test_the_region_size_is_the_one_the_library_lays_out():
    for world, slot in ((2, 4096), (3, 512 << 10), (8, 1 << 20)):
        assert native.region_bytes(world, slot) == torch.ops.tensorshard.native_region_bytes(world, slot)


def test_without_a_compiler_or_when_turned_off_the_reason_is_logged_once(monkeypatch):
    monkeypatch.setattr(library, "_state", {})  # as in a fresh process (restored after the test)
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", "/nonexistent")
    logged, stop = log_messages("tensorshard.comm.native.library", logging.WARNING)
    try:
        assert not library.load() and not library.load()
    finally:
        stop()
    assert library.why_not().startswith("no C++ compiler found")
    assert len(logged) == 1 and "the Python collectives carry them instead: no C++ compiler found" in logged[0]
    monkeypatch.setattr(library, "_state", {})
    monkeypatch.setenv(library.ENV, "0")
    assert not library.load() and library.why_not() == "TENSORSHARD_NATIVE=0"
