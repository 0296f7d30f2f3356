"""The shared-memory transport between CPU ranks of one host (comm/shm.py): used by default, the same bits
on every rank and on every run (each element combined in rank order 0..N-1), gloo's bits at 2 ranks, any
size (several rounds past a slot), and gloo again with TENSORSHARD_SHM=0. Faults through it are in
tests/reliability/test_torchrun_faults.py."""

from __future__ import annotations

import copy
import hashlib
import os

import pytest
import torch
import torch.distributed as dist

import tensorshard as tp
from support import plans
from support.harness import world_mesh
from support.helpers import rel_err
from support.models import FeedForward
from tensorshard.comm import shm, shm_setup, transport
from tensorshard.comm.dist_guard import guard_for

pytestmark = pytest.mark.timeout(120)

_gloo_only: dict[int, object] = {}


def _gloo_group():
    """A second group over the same ranks, kept on gloo (one per worker process)."""
    world = dist.get_world_size()
    if world not in _gloo_only:
        _gloo_only[world] = dist.new_group(list(range(world)))
    return _gloo_only[world]


def _inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g, dtype=torch.float64) * 3).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)


def _fixed_order(parts: list[torch.Tensor], combine) -> torch.Tensor:
    out = combine(parts[0], parts[1])
    for p in parts[2:]:
        out = combine(out, p)
    return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def collectives_task(numel: int, dtype_name: str) -> dict:
    """all-reduce (sum, max), all-gather and reduce-scatter of `numel` elements per rank through shared memory,
    against the same combination computed here in rank order, and against gloo."""
    dtype = getattr(torch, dtype_name)
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    guard = guard_for(group)
    transport.connect(guard, "cpu")
    everyone = [_inputs(r, numel, dtype) for r in range(world)]
    mine = everyone[rank]
    out: dict = {"shm": guard.shm is not None}

    summed = mine.clone()
    transport.all_reduce_(summed, group, what="test")
    again = mine.clone()
    transport.all_reduce_(again, group, what="test")
    out["sum_exact"] = torch.equal(summed, _fixed_order(everyone, torch.add))
    out["sum_repeats"] = torch.equal(summed, again)
    out["sum_digest"] = _digest(summed)

    largest = mine.clone()
    transport.all_reduce_(largest, group, dist.ReduceOp.MAX, what="test")
    out["max_exact"] = torch.equal(largest, _fixed_order(everyone, torch.maximum))

    gathered = mine.new_empty(world * numel)
    transport.all_gather_(gathered, mine, group, what="test")
    out["gather_exact"] = torch.equal(gathered, torch.cat(everyone))

    block = numel // world
    if block:
        scattered = mine.new_empty(block)
        transport.reduce_scatter_(scattered, mine[: world * block].contiguous(), group, what="test")
        expected = _fixed_order([e[: world * block] for e in everyone], torch.add)[rank * block : (rank + 1) * block]
        out["scatter_exact"] = torch.equal(scattered, expected)

    if dtype == torch.float32:
        by_gloo = mine.clone()
        transport.all_reduce_(by_gloo, _gloo_group(), what="test")
        out["gloo_equal"] = torch.equal(by_gloo, summed)
        out["gloo_close"] = rel_err(by_gloo.double(), summed.double()) < 1e-6
    return out


SLOT_2 = shm_setup._slot_bytes(2) // 4  # float32 elements in one slot at 2 ranks
SLOT_4 = shm_setup._slot_bytes(4) // 4


@pytest.mark.parametrize("numel, dtype", [
    (1, "float32"), (1000, "float32"), (1000, "bfloat16"), (777, "int64"),
    (SLOT_2 + 13, "float32"),  # two rounds
    (SLOT_4 + 13, "float64"),  # 4 ranks: rounds past the small-round size, reduced in parts
])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_results_are_the_fixed_order_combination_on_every_rank(pool2, pool3, pool4, world, numel, dtype):
    results = {2: pool2, 3: pool3, 4: pool4}[world].run(collectives_task, numel, dtype)
    assert all(r["shm"] for r in results)  # CPU processes of one host: shared memory by default
    for r in results:
        assert r["sum_exact"] and r["sum_repeats"] and r["max_exact"] and r["gather_exact"]
        assert r.get("scatter_exact", True)
    assert len({r["sum_digest"] for r in results}) == 1  # bit-identical on every rank
    if dtype == "float32":
        assert all(r["gloo_close"] for r in results)
        if world == 2:
            assert all(r["gloo_equal"] for r in results)  # a + b == b + a: gloo's bits exactly


def training_task(shared: bool) -> dict:
    """Two AdamW steps of a split FeedForward, on a fresh group with shared memory on or off."""
    world = dist.get_world_size()
    os.environ[shm_setup.ENV] = "1" if shared else "0"
    try:
        group = dist.new_group(list(range(world)))
        from torch.distributed.device_mesh import DeviceMesh

        torch.manual_seed(0)
        ref = FeedForward(32, 64)
        model = tp.parallelize(copy.deepcopy(ref), DeviceMesh.from_group(group, "cpu"), plan=plans.FEED_FORWARD)
        used = model.tensorshard.comm.guard.shm is not None
    finally:
        os.environ.pop(shm_setup.ENV, None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        x = torch.randn(4, 32, generator=gen)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(x).square().mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
    return {"used": used, "losses": losses, "w2": _digest(model.w2.weight.to_local().detach())}


def test_training_matches_with_and_without_shared_memory(pool2):
    on, off = pool2.run(training_task, True), pool2.run(training_task, False)
    assert [r["used"] for r in on] == [True, True] and [r["used"] for r in off] == [False, False]
    for r in on + off:
        for split, single in r["losses"]:
            assert abs(split - single) <= 1e-5 * abs(single)
    assert on[0]["losses"] == off[0]["losses"]  # 2 ranks: gloo's sums bit for bit
    assert [r["w2"] for r in on] == [r["w2"] for r in off]


def test_parts_and_slot_sizes():
    assert [shm._span(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [shm._span(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert shm_setup._slot_bytes(2) == 2 << 20 and shm_setup._slot_bytes(8) % 64 == 0 and shm_setup._slot_bytes(8) < 2 << 20


def test_the_variable_turns_it_off(monkeypatch):
    monkeypatch.setenv(shm_setup.ENV, "0")
    assert not shm_setup.enabled()
    monkeypatch.setenv(shm_setup.ENV, "1")
    assert shm_setup.enabled()


def mismatch_task() -> dict:
    """The ranks reach different collectives (here: all-reduces of different sizes, as after different batch
    shapes) on a fresh group: both stop at once, each naming what the other was doing."""
    import time

    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    guard = guard_for(group, 30)
    transport.connect(guard, "cpu")
    t = torch.ones(4 if rank == 0 else 8)
    began = time.monotonic()
    try:
        transport.all_reduce_(t, group, what=f"all_reduce at w{rank + 1}")
    except TimeoutError as e:
        return {"message": str(e), "seconds": time.monotonic() - began, "shm": guard.shm is not None}
    return {"message": "finished", "seconds": time.monotonic() - began}


def test_ranks_at_different_collectives_stop_at_once_naming_each_other(pool2):
    first, second = pool2.run(mismatch_task)
    assert first["shm"] and second["shm"]
    assert "all_reduce at w1 on rank 0" in first["message"], first["message"]
    assert "the ranks are at different collectives (rank 1 at all_reduce at w2 (8 float32))" in first["message"]
    assert "(rank 0 at all_reduce at w1 (4 float32))" in second["message"], second["message"]
    assert first["seconds"] < 5 and second["seconds"] < 5  # not the 30 s limit
