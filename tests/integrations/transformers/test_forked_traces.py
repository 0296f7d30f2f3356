"""The first fast call of a kind with every shard's step traced at the same time, each in a forked child
(engines/inprocess/forked_traces.py): this process traces nothing, the step is built from the children's captures,
and decodes the unsplit model's tokens with the eager step's collectives. A child that fails or deadlocks leaves the
kind to this process's own trace, as before, with the reason logged."""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading
import time

import pytest
import torch

import tensorshard as tp
from tensorshard.engines.inprocess import forked_traces
from tensorshard.engines.inprocess.stitched_decode import STITCHES, Stitcher
from support.hf_configs import tiny_model
from support.helpers import log_messages

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not STITCHES, reason="captures are stitched from torch 2.13 on"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked traces are Linux's only"),
]

FORKED = "traced at the same time in forked processes"
FELL_BACK = "could not be traced in forked processes"


@pytest.fixture(autouse=True)
def forked(monkeypatch):
    """Forked traces on (the suite turns them off, tests/conftest.py); dynamo's caches emptied."""
    torch._dynamo.reset()
    monkeypatch.setenv(forked_traces.ENV, "1")


def _ids() -> torch.Tensor:
    return torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(0))


def _greedy(model, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(_ids(), attention_mask=torch.ones_like(_ids()), max_new_tokens=5, do_sample=False, **kwargs)


def _fast(split) -> tuple[torch.Tensor, list[str], int, dict]:
    """The fast path's tokens, its log, the graphs dynamo traced in this process on the way, and its collectives."""
    messages, stop = log_messages("tensorshard.engines.inprocess", 20)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    try:
        with tp.count_collectives() as counted:
            out = _greedy(split, cache_implementation="static")
    finally:
        stop()
    return out, messages, torch._dynamo.utils.counters["stats"]["unique_graphs"] - before, dict(counted.counts)


def _stitcher(split) -> Stitcher:
    [steps] = split.__dict__["_tensorshard_compiled_steps"].values()  # (one set of compile options)
    return steps.stitcher


@pytest.mark.parametrize("devices", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_the_shards_are_traced_at_the_same_time_in_children_and_decode_the_unsplit_tokens(devices):
    model = tiny_model("llama")
    expected = _greedy(model)
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * devices)
    out, messages, traced, counts = _fast(split)
    assert torch.equal(out, expected), messages
    assert traced == 0 and len([m for m in messages if FORKED in m]) == 1, (traced, messages)  # no trace here
    [spans] = _stitcher(split).spans.values()
    cores = len(os.sched_getaffinity(0))
    together = spans[:min(devices, cores)]
    if len(together) > 1:  # every child of a wave started before any of them ended: not one after the other
        assert max(start for start, _ in together) < min(end for _, end in together), spans
    with tp.count_collectives() as eager:
        _greedy(split, cache_implementation="static", disable_compile=True)
    assert counts == eager.counts and counts["all_reduce"] > 0


def test_a_child_that_fails_leaves_the_kind_to_this_processs_trace(monkeypatch):
    parent = os.getpid()
    cheap = Stitcher._cheap_tracing

    def failing_in_children(self, **kwargs):
        if os.getpid() != parent:
            raise RuntimeError("a failure only a child sees")
        return cheap(self, **kwargs)

    monkeypatch.setattr(Stitcher, "_cheap_tracing", failing_in_children)
    model = tiny_model("llama")
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"])
    out, messages, traced, _ = _fast(split)
    assert torch.equal(out, _greedy(model))
    assert traced == 2 and not [m for m in messages if FORKED in m], (traced, messages)  # traced here, per shard
    assert [m for m in messages if FELL_BACK in m and "RuntimeError: a failure only a child sees" in m], messages


def test_a_child_blocked_on_a_lock_held_at_the_fork_is_stopped_and_named(monkeypatch):
    """The case a fork cannot rule out: another thread held a lock when the child was made, and the child waits
    for it for ever. Such a child uses no CPU; it is killed after STALL seconds, and nothing changed here."""
    monkeypatch.setattr(forked_traces, "STALL", 1.0)
    lock, held, release = threading.Lock(), threading.Event(), threading.Event()

    def holder():
        with lock:
            held.set()
            release.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(5)
    try:
        split = tp.tensor_parallel(tiny_model("llama"), ["cpu", "cpu"])
        started = time.monotonic()
        with pytest.raises(forked_traces.TraceFailed, match="used no CPU for 1 s"):
            forked_traces.trace(split, [{}, {}], lambda: _acquired(lock), {})
        assert time.monotonic() - started < 20
    finally:
        release.set()
        thread.join()


@contextlib.contextmanager
def _acquired(lock: threading.Lock):
    with lock:
        yield


def test_the_childrens_captures_are_kept_on_disk_for_a_later_model(tmp_path, monkeypatch):
    from tensorshard.engines import capture_store

    monkeypatch.setenv("TENSORSHARD_CAPTURE_CACHE", "1")
    monkeypatch.setattr(capture_store, "folder", lambda: tmp_path / "captures")
    model = tiny_model("llama")
    expected = _greedy(model)
    out, messages, _, _ = _fast(tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"]))
    assert torch.equal(out, expected) and [m for m in messages if FORKED in m], messages
    assert len(list((tmp_path / "captures").glob("*.pkl"))) == 1
    out, messages, traced, _ = _fast(tp.tensor_parallel(copy.deepcopy(model), ["cpu", "cpu"]))
    assert torch.equal(out, expected) and traced == 0, messages
    assert [m for m in messages if "kept on disk" in m] and not [m for m in messages if FORKED in m], messages
