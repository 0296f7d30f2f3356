"""Bad input under torchrun gets a clear error and changes nothing (the in-process engine's counterpart is
test_bad_input.py).

Each case is one row of the torchrun table in docs/errors.md (`test_docs_rows_match_the_cases` keeps them
in step). Cases that need no process group run here; the others on every rank of a 2-process gloo pool,
where the model is also checked to be exactly as it was.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import tensorshard as tp
from support import ROOT, plans
from support.models import FeedForward
from support.workers_state import assert_unchanged, snapshot

pytestmark = pytest.mark.timeout(120)

DOCS = ROOT / "docs" / "errors.md"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Case:
    id: str
    call: Callable[[], Any]  # what the user does
    error: type
    excerpt: str  # a piece of the message, as docs/errors.md quotes it
    setup: Callable | None = None  # (monkeypatch) -> None; no-process-group cases only


def fake_gpus(monkeypatch, count=2):
    """This machine has no GPU: let the checks see `count` of them (no CUDA call is made)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def outside_torchrun(monkeypatch):
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)


def under_torchrun_as(rank: int, local_world: int | None = None):
    """torchrun's variables for `rank` of 4 processes on one node (no process group is made: refused before)."""

    def setup(monkeypatch):
        env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 4, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}
        for key, value in env.items():
            monkeypatch.setenv(key, str(value))
        if local_world is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
        fake_gpus(monkeypatch)

    return setup


def distributed(**kwargs):
    return lambda: tp.tensor_parallel(FeedForward(16, 32), plan=plans.FEED_FORWARD, distributed=True, **kwargs)


# --- no process group needed: refused before one is made ----------------------------------------------------

LOCAL = [
    Case("distributed-without-process-group", distributed(), RuntimeError,
         "launch the script with `torchrun --nproc_per_node=N script.py` (or call torch.distributed.init_process_group() first)",
         setup=outside_torchrun),
    Case("gpu-missing-for-local-rank", distributed(), ValueError,
         "rank 3 (LOCAL_RANK=3) has no GPU: 2 cuda device(s) are visible (cuda:0..cuda:1). Start at most 2 process(es) per node (torchrun --nproc_per_node=2)",
         setup=under_torchrun_as(3)),
    Case("gpus-fewer-than-local-processes", distributed(), ValueError,
         "rank 0 (LOCAL_RANK=0): this node runs 4 processes (LOCAL_WORLD_SIZE) but 2 cuda device(s) are visible, and "
         "NCCL needs a GPU per process. Start at most 2 process(es) per node (torchrun --nproc_per_node=2), make more "
         "GPUs visible (CUDA_VISIBLE_DEVICES), or pass device_ids=['cpu'] to run every rank on the CPU with gloo",
         setup=under_torchrun_as(0, local_world=4)),
    Case("device-ids-gpu-does-not-exist", distributed(device_ids=["cuda:5"]), ValueError,
         "device_ids[0] 'cuda:5' does not exist: 2 cuda device(s) are visible (cuda:0..cuda:1)", setup=fake_gpus),
    Case("device-ids-several", distributed(device_ids=["cpu", "cpu"]), ValueError,
         "with distributed=True each process drives one device; device_ids=['cpu', 'cpu'] lists 2"),
    Case("distributed-and-sharded", distributed(sharded=True), NotImplementedError,
         "sharded=True with distributed=True: shard the replicated parameters with torch's fully_shard on a data-parallel mesh"),
    Case("timeout-env-malformed", distributed(), ValueError, "TENSORSHARD_TIMEOUT='soon' is not a number of seconds",
         setup=lambda mp: mp.setenv("TENSORSHARD_TIMEOUT", "soon")),
    Case("parallelize-without-a-mesh", lambda: tp.parallelize(FeedForward(16, 32), "cpu", plan=plans.FEED_FORWARD), TypeError,
         "device_mesh must be a torch DeviceMesh, got str; build one with torch.distributed.device_mesh.init_device_mesh"),
]


@pytest.mark.parametrize("case", LOCAL, ids=[c.id for c in LOCAL])
def test_torchrun_rejected(case, monkeypatch):
    assert not dist.is_initialized()
    if case.setup:
        case.setup(monkeypatch)
    with pytest.raises(case.error) as info:
        case.call()
    assert case.excerpt in str(info.value), str(info.value)
    assert not dist.is_initialized()  # nothing was started


# --- on every rank of a 2-process pool -----------------------------------------------------------------------


def mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def model():
    torch.manual_seed(0)
    return FeedForward(16, 32)


def rank_batch():
    return torch.randn(2, 16, generator=torch.Generator().manual_seed(dist.get_rank()))


# `call(model)`: parallelize() cases get the unsplit model, which must be left exactly as it was; call cases
# (`split=True`) get the split model, which must still answer the next (good) call like the unsplit one.
POOL = [
    Case("mesh-2d", lambda m: tp.parallelize(m, init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel")), plan=plans.FEED_FORWARD),
         ValueError, "parallelize() needs the 1-D tensor-parallel mesh; got a 2-D mesh with dims ('data_parallel', 'tensor_parallel'). Pass its tensor-parallel dimension, e.g. mesh['tensor_parallel']"),
    Case("plan-key-matches-nothing", lambda m: tp.parallelize(m, mesh(), plan={"w4": tp.ColwiseParallel()}),
         ValueError, "'w4' matches no module of FeedForward. Closest module names: w3, w2, w1"),
    Case("src-data-rank-outside-the-mesh", lambda m: tp.parallelize(m, mesh(), plan=plans.FEED_FORWARD, src_data_rank=5),
         ValueError, "src_data_rank=5 is not a rank of the 2-rank mesh; use 0..1 or None"),
    Case("check-inputs-negative", lambda m: tp.parallelize(m, mesh(), plan=plans.FEED_FORWARD, check_inputs=-1),
         ValueError, "check_inputs must be a number of calls >= 0; got -1"),
    Case("timeout-zero", lambda m: tp.parallelize(m, mesh(), plan=plans.FEED_FORWARD, timeout=0),
         ValueError, "timeout: 0.0 is not a positive, finite number of seconds"),
    Case("plans-differ-across-ranks",
         lambda m: tp.parallelize(m, mesh(), plan=plans.FEED_FORWARD if dist.get_rank() == 0 else {"w[13]": tp.ColwiseParallel()}),
         ValueError, "the tensor-parallel ranks resolved different plans: rank(s) [1] differ from rank 0"),
    Case("inputs-differ-across-ranks", lambda m: m(rank_batch()), tp.InputMismatchError,
         "tensor-parallel ranks received different inputs: input 'x' of FeedForward differs between rank 0 (shape [2, 16], float32"),
    Case("input-on-the-meta-device", lambda m: m(torch.empty(2, 16, device="meta")), ValueError,
         "input 'x' (shape [2, 16]) is on the meta device: it has no values to compute with"),
]
SPLIT_FIRST = {"inputs-differ-across-ranks", "input-on-the-meta-device"}


def pool_case_task(index: int) -> tuple[str, str]:
    case = POOL[index]
    original = model()
    split = case.id in SPLIT_FIRST
    target = tp.parallelize(original, mesh(), plan=plans.FEED_FORWARD) if split else original
    before = None if split else snapshot(original)
    try:
        case.call(target)
    except Exception as e:  # noqa: BLE001 - compared by the test
        if split:
            x = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))  # the same batch on every rank
            assert torch.allclose(target(x), model()(x), atol=1e-6)
        else:
            assert_unchanged(original, before)
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.parametrize("index", range(len(POOL)), ids=[c.id for c in POOL])
def test_torchrun_rejected_on_every_rank(index, pool2):
    case = POOL[index]
    for kind, message in pool2.run(pool_case_task, index):
        assert kind == case.error.__name__, message
        assert case.excerpt in message, message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_inputs_on_another_device_are_moved(monkeypatch):
    """One process, a 1-rank CUDA mesh: CPU inputs are moved to the rank's GPU (as DDP and FSDP2 do)."""
    from support.harness import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        ref = model()
        split_model = tp.parallelize(model().cuda(), init_device_mesh("cuda", (1,)), plan=plans.FEED_FORWARD)
        x = torch.randn(2, 16)
        out = split_model(x)  # on the CPU
        assert out.device.type == "cuda" and torch.allclose(out.cpu(), ref(x), atol=1e-5)
    finally:
        dist.destroy_process_group()


# --- the docs -----------------------------------------------------------------------------------------------


def test_docs_rows_match_the_cases():
    """Every case has a row in docs/errors.md quoting its error type and message."""
    text = DOCS.read_text()
    rows = {}
    for line in text.splitlines():
        for m in re.finditer(r"(test_torchrun_rejected(?:_on_every_rank)?)\[([\w-]+)\]", line):
            rows[m.group(2)] = (m.group(1), line)
    cases = {c.id: ("test_torchrun_rejected", c) for c in LOCAL} | {c.id: ("test_torchrun_rejected_on_every_rank", c) for c in POOL}
    assert set(rows) == set(cases)
    for id, (test, case) in cases.items():
        cited, row = rows[id]
        assert cited == test, id
        assert f"`{case.error.__name__}`" in row, id
        assert case.excerpt.replace("|", "\\|") in row, id
