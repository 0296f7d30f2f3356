"""The rendezvous on CPU slots: every shard computes its own result of a collective, at the same time.

What it promises: the same bits on every shard (rank-ordered sums), a tensor of its own for every shard,
no shard changing its input in place while another still reads it, and a failure in one shard's share of
the work stopping the others with an error that points at it."""

import threading

import pytest
import torch

from tensorshard.comm.rendezvous import CollectiveAborted, ThreadGroup
from tensorshard.comm.threads import ThreadComm
from tensorshard.partition import Partition, split_evenly

pytestmark = pytest.mark.timeout(60)


def run_shards(group: ThreadGroup, body, n: int):
    """body(rank) for every rank, one thread each, as one call of `group`; results (or errors) by rank."""
    call = group.begin("forward")
    out: dict[int, object] = {}

    def shard(rank):
        try:
            out[rank] = group.run_shard(call, rank, lambda: body(rank))
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out[rank] = e

    threads = [threading.Thread(target=shard, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    group.end(call)
    return out


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rows", [256, 1], ids=["each-sums", "one-sums-for-all"])  # 1 MiB; 4 KiB (a decode step)
def test_each_shard_gets_its_own_bit_identical_sum_and_may_change_its_input_right_after(n, rows, gen):
    group = ThreadGroup([torch.device("cpu")] * n, timeout=20)
    xs = [torch.randn(rows, 1024, generator=gen) for _ in range(n)]
    expected = xs[0] + xs[1]
    for x in xs[2:]:
        expected += x

    def body(rank):
        x = xs[rank].clone()
        y = ThreadComm(group, rank).all_reduce(x, where="test")
        x.fill_(float("nan"))  # in place, as soon as it returns: no other shard may still be reading it
        return y

    ys = run_shards(group, body, n)
    assert all(torch.equal(ys[r], expected) for r in range(n))
    assert len({ys[r].data_ptr() for r in range(n)}) == n  # a tensor of its own: a shard may modify it


def test_each_shard_assembles_its_own_all_gather(gen):
    n = 3
    group = ThreadGroup([torch.device("cpu")] * n, timeout=20)
    sizes = split_evenly(10, n)  # 4, 3, 3
    part = Partition(10, tuple(((sum(sizes[:r]), sum(sizes[: r + 1])),) for r in range(n)))
    full = torch.randn(8192, 10, generator=gen)  # 320 KiB gathered: each shard assembles its own
    pieces = list(full.split(sizes, dim=1))
    ys = run_shards(group, lambda r: ThreadComm(group, r).all_gather(pieces[r].clone(), 1, part, where="test"), n)
    assert all(torch.equal(ys[r], full) for r in range(n))
    assert len({ys[r].data_ptr() for r in range(n)}) == n


def test_a_shard_failing_in_its_own_share_stops_the_others_naming_the_error():
    group = ThreadGroup([torch.device("cpu")] * 2, timeout=20)

    def each(payloads, rank):
        if rank == 1:
            raise MemoryError("no room for the sum")
        return payloads[0] + payloads[1]

    out = run_shards(group, lambda r: group.exchange(r, "all_reduce", "test", torch.ones(2), lambda xs: None, each=each), 2)
    assert isinstance(out[1], MemoryError)
    assert isinstance(out[0], CollectiveAborted) and "no room for the sum" in str(out[0])


def test_debug_mode_computes_every_result_in_the_last_shard_to_arrive():
    group = ThreadGroup([torch.device("cpu")] * 2, timeout=20, serial=True)
    threads = {}

    def each(payloads, rank):
        threads[rank] = threading.current_thread().name
        return payloads[0] + payloads[1]

    out = run_shards(group, lambda r: group.exchange(r, "all_reduce", "test", torch.full((2,), r + 1.0), lambda xs: None, each=each), 2)
    assert torch.equal(out[0], torch.full((2,), 3.0)) and torch.equal(out[1], torch.full((2,), 3.0))
    assert threads[0] == threads[1]  # one shard at a time: one thread computed both
