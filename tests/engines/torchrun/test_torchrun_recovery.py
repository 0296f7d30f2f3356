"""After a failure, the native collectives of a torchrun group (comm/native/: what compiled decode steps call) come
back when the ranks went through it together, and say "out of step" at once when they did not (comm/recovery.py).

A reported failure marks the group's native region failed. Before comm/recovery.py the mark stayed for good: in one
worker's pool, tests/engines/torchrun/test_torchrun_causal_lm_loss.py's refused labels (a ValueError on every rank)
left every later compiled graph of the pool's group (generate's decode steps, test_torchrun_compile.py's compiled
forward) failing with "the group failed on rank 1 before".
`test_compiled_decoding_works_again_after_every_rank_raised_the_same_error` runs that sequence in one task.

The other cases use a fresh group each (so the pool's own group stays usable): ranks failing together at a Python
and at a native collective, a rank slower to fail than the others, a rank behind that has not yet been through the
failed call, a rank failing alone with the others stopped or going on, and a rank that never comes back.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist

import tensorshard as tp
from support import tiny_llama
from support.harness import world_mesh
from tensorshard.comm import transport
from tensorshard.comm.dist_guard import guard_for
from tensorshard.comm.native import ops as native
from tensorshard.comm.recovery import GroupOutOfStep

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not native.available(), reason=f"native collectives unavailable: {native.why_not()}")]


def _native_group(timeout: float):
    """A fresh group over every rank with its shared-memory transport and native group: (guard, handle, group rank)."""
    group = dist.new_group(list(range(dist.get_world_size())))
    guard = guard_for(group, timeout)
    transport.connect(guard, "cpu")
    handle = transport.connect_native(guard)
    assert handle is not None and guard.shm is not None
    return guard, handle, guard.shm.rank


def _sum_works(handle: int, rank: int, where: str) -> bool:
    """A native all-reduce of every rank's (rank + 1) gives the sum on this rank."""
    world = dist.get_world_size()
    got = torch.ops.tensorshard.native_all_reduce(torch.full((64,), float(rank + 1)), handle, rank, where)
    return torch.equal(got, torch.full((64,), float(world * (world + 1) // 2)))


def _python_sum(guard) -> bool:
    t = torch.ones(8)
    transport.all_reduce_(t, guard.group, what="all_reduce at check")
    return torch.equal(t, torch.full((8,), float(dist.get_world_size())))


def _outcome(began: float, call) -> dict:
    try:
        value = call()
    except Exception as e:  # noqa: BLE001 - the test looks at which error, and when
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - began}
    return {"error": "", "value": value, "seconds": time.monotonic() - began}


def together_task() -> dict:
    """1. Every rank raises the same error after the same Python collective; rank 0 a second later than rank 1
    (rank 1 reaches the check first and must wait for it, not decide alone). 2. Rank 1 fails inside the compiled
    step (its report stops rank 0, waiting in a native all-reduce, which reports that error in turn, as decoding.py
    does). After each, the next call of connect_native (every compiled decode call's first step) restores the group:
    same handle, exact sums, the Python collectives unaffected by the old reports."""
    guard, handle, rank = _native_group(60)
    out = {"before": [_sum_works(handle, rank, "before"), _python_sum(guard)]}  # (both on every rank: no short cut)
    if rank == 0:
        time.sleep(1.0)
    guard.report(ValueError("labels outside the vocabulary"), "the forward of Tiny")
    # (the mark as read from the segment is the C++ side's word: 1 + the rank that set it first)
    out["marked"] = native.broken(guard.shm) == torch.ops.tensorshard.native_group_broken(handle) != 0
    began = time.monotonic()
    out["first"] = _outcome(began, lambda: (transport.connect_native(guard) == handle, _sum_works(handle, rank, "after")))
    out["python"] = _python_sum(guard)
    if rank == 1:
        guard.report(RuntimeError("shard state broke"), "the compiled decode step of Tiny")
        out["waiting"] = ""
    else:
        waiting = _outcome(time.monotonic(), lambda: _sum_works(handle, rank, "waiting"))
        out["waiting"] = waiting["message"]
        guard.report(RuntimeError(waiting["message"]), "the compiled decode step of Tiny")
    out["second"] = _outcome(time.monotonic(), lambda: (transport.connect_native(guard) == handle, _sum_works(handle, rank, "again")))
    out["python_again"] = _python_sum(guard)
    out["recoveries"], out["clear"] = guard.recoveries, native.broken(guard.shm) == 0
    return out


def test_ranks_that_failed_together_get_their_native_collectives_back(pool2):
    for rank, out in enumerate(pool2.run(together_task)):
        assert out["before"] == [True, True] and out["marked"], out
        assert out["first"]["error"] == "" and out["first"]["value"] == (True, True), out
        assert out["first"]["seconds"] < (5 if rank == 0 else 10), out  # rank 1 waited for rank 0's own failure
        assert out["python"] and out["python_again"], out
        if rank == 0:
            assert "the group failed on rank 1 before (rank 1 raised RuntimeError: shard state broke)" in out["waiting"]
        assert out["second"]["error"] == "" and out["second"]["value"] == (True, True), out
        assert out["recoveries"] == 2 and out["clear"], out


def behind_task() -> dict:
    """Rank 1 fails in a compiled decode call (after its check) before rank 0 has begun that call: rank 0's check
    finds the mark but does not restore the group yet (it has not been through that call); its first native
    collective raises at once, and both ranks restore the group at the next call."""
    guard, handle, rank = _native_group(60)
    out = {}
    if rank == 1:
        transport.connect_native(guard)  # the call's check: the group is well
        guard.report(ValueError("bad step"), "the compiled decode step of Tiny")
    else:
        time.sleep(0.5)  # (behind: rank 1's report is in the store)
        out["behind"] = _outcome(time.monotonic(), lambda: (transport.connect_native(guard), guard.recoveries))
        waiting = _outcome(time.monotonic(), lambda: _sum_works(handle, rank, "step"))
        out["waiting"] = (waiting["message"], waiting["seconds"])
        guard.report(RuntimeError(waiting["message"]), "the compiled decode step of Tiny")
    out["next"] = _outcome(time.monotonic(), lambda: (transport.connect_native(guard) == handle, _sum_works(handle, rank, "next")))
    out["recoveries"] = guard.recoveries
    return out


def test_a_rank_behind_goes_through_the_failed_call_before_the_group_is_restored(pool2):
    first, second = pool2.run(behind_task)
    assert first["behind"]["error"] == "" and first["behind"]["value"] == (first["behind"]["value"][0], 0), first
    message, seconds = first["waiting"]
    assert "the group failed on rank 1 before (rank 1 raised ValueError: bad step)" in message and seconds < 5, first
    for out in (first, second):
        assert out["next"]["error"] == "" and out["next"]["value"] == (True, True), out
        assert out["recoveries"] == 1, out


def alone_task(stopped: bool) -> dict:
    """Rank 1 raises alone after the group's first collective. `stopped`: rank 0 goes on to the next collective and
    is stopped there (CollectiveAborted); else it goes straight on to a compiled decode call. Either way every rank's
    next connect_native raises GroupOutOfStep at once (the limit is 60 s), naming what happened."""
    guard, handle, rank = _native_group(60)
    _python_sum(guard)
    out = {}
    if rank == 1:
        guard.report(ValueError("bad batch on rank 1"), "the forward of Tiny")
    elif stopped:
        out["stopped"] = _outcome(time.monotonic(), lambda: _python_sum(guard))["error"]
    else:
        time.sleep(0.5)  # (rank 1's report is in the store)
    out.update(_outcome(time.monotonic(), lambda: transport.connect_native(guard)))
    return out


@pytest.mark.parametrize("stopped", [True, False])
def test_a_rank_that_failed_alone_leaves_every_rank_out_of_step_at_once(pool2, stopped):
    first, second = pool2.run(alone_task, stopped)
    if stopped:
        assert first["stopped"] == "CollectiveAborted", first
    for out in (first, second):
        assert out["error"] == "GroupOutOfStep" and out["seconds"] < 10, out
        assert "the ranks are out of step" in out["message"] and "end the job" in out["message"], out
    if stopped:
        assert "rank 0 was stopped while it waited for another rank (CollectiveAborted: all_reduce at check" in first["message"]
    else:
        assert "rank 0 went on where rank 1 failed alone (rank 1 raised ValueError: bad batch on rank 1" in first["message"]
    assert first["message"].split(": the ranks are out of step: ")[1] == second["message"].split(": the ranks are out of step: ")[1]


def absent_task() -> dict:
    """Both ranks fail together, but rank 1 never calls a compiled step again: rank 0 gives up at the limit (2 s),
    naming rank 1."""
    guard, handle, rank = _native_group(2)
    guard.report(ValueError("bad batch"), "the forward of Tiny")
    if rank == 1:
        time.sleep(4)
        return {}
    return _outcome(time.monotonic(), lambda: transport.connect_native(guard))


def test_a_rank_that_does_not_come_back_is_named_within_the_limit(pool2):
    first, _ = pool2.run(absent_task)
    assert first["error"] == "TimeoutError" and "rank(s) [1] did not come to restore them within 2 s" in first["message"], first
    assert 1.9 < first["seconds"] < 8, first


def compiled_task() -> dict:
    """What the order of the test files did: generate()'s compiled decode step connects the native collectives,
    then every rank refuses labels outside the vocabulary (a ValueError, reported), then compiled decoding again;
    after a second such failure, a new split model of the same group, compiled by hand and by generate. Dynamo alone
    (backend "eager"): the graphs hold the native ops."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    ref = tiny_llama.build()
    model = tp.parallelize(copy.deepcopy(ref), world_mesh(), plan=tiny_llama.plan(), check_inputs=0)
    guard = model.tensorshard.comm.guard
    ids = torch.randint(0, tiny_llama.VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    static = dict(settings, cache_implementation="static", compile_config=CompileConfig(backend="eager"))
    out = {}
    with torch.no_grad():
        expected = ref.generate(ids, **settings).tolist()
        model.generate(ids, **static)  # (compiles)
        with tp.count_collectives() as before:
            out["before"] = model.generate(ids, **static).tolist() == expected
        out["connected"] = guard.native is not None
        recoveries = guard.recoveries  # (the pool's group may have been restored by an earlier test)

        def refuse():  # labels outside the vocabulary: a ValueError on every rank, reported
            labels = ids.clone()
            labels[0, 2] = tiny_llama.VOCAB
            try:
                model(input_ids=ids, labels=labels)
                out["refused"] = ""
            except ValueError as e:
                out["refused"] = str(e)
            out["marked"] = out.get("marked", True) and native.broken(guard.shm) != 0

        refuse()
        with tp.count_collectives() as after:
            out["after"] = model.generate(ids, **static).tolist() == expected
        refuse()
        # a new split model of the group: parallelize restores them, before any compiled decode call; a forward of
        # the user's own torch.compile (no gradient: the native collectives too) gives the unsplit logits
        second = tp.parallelize(copy.deepcopy(ref), world_mesh(), plan=tiny_llama.plan(), check_inputs=0)
        out["restored by parallelize"] = native.broken(guard.shm) == 0
        logits = torch.compile(second.forward, backend="eager")(ids).logits
        want = ref(ids).logits
        out["compiled forward"] = ((logits - want).abs().max() / want.abs().max()).item()
        out["new model"] = second.generate(ids, **static).tolist() == expected
    out["counts"] = (before.counts, after.counts)
    out["recoveries"] = guard.recoveries - recoveries
    return out


def test_compiled_decoding_works_again_after_every_rank_raised_the_same_error(pool2):
    for out in pool2.run(compiled_task, timeout=240):
        assert out["before"] and out["connected"] and out["marked"], out
        assert f"class {tiny_llama.VOCAB}, outside the vocabulary" in out["refused"], out
        assert out["after"] and out["new model"] and out["restored by parallelize"], out
        assert out["compiled forward"] < 1e-5, out  # fp32, the same sums in another order
        before, after = out["counts"]
        assert before == after and before.get("all_reduce", 0) > 0, out  # the same collectives as before the failure
        assert out["recoveries"] == 2, out  # at the compiled decode call, then at parallelize
