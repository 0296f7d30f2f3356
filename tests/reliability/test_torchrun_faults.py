"""No hang under torchrun: a rank that is killed, exits, raises or stalls stops the others promptly, with an
error naming the rank and the operation (CPU ranks in 3 fresh processes, see spawned.py, with the collectives
through shared memory, the default on one host, and through gloo; and once under torchrun itself).

The in-process engine's counterpart is test_no_hang.py. docs/errors.md lists each case with its message.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import tensorshard as tp
from support import plans, spawned
from support.harness import PG_TIMEOUT, child_env
from support.models import TwoBlocks

pytestmark = pytest.mark.timeout(240)  # the scenario's fixture: spawned.run's own limit (180 s), and more

HERE = os.path.dirname(__file__)


def split(group, **kwargs) -> nn.Module:
    return tp.parallelize(TwoBlocks(), DeviceMesh.from_group(group, "cpu"), plan=plans.TWO_BLOCKS, **kwargs)


def step(model, gen) -> None:
    model(torch.randn(4, 8, generator=gen)).sum().backward()


def same_batches() -> torch.Generator:
    """Test data for one case: the same batches on every rank of its group."""
    return torch.Generator().manual_seed(0)


def before_b2(model, action) -> None:
    """Run `action` on this rank between the forward's two all-reduces (before b2's)."""
    model.b2.register_forward_pre_hook(lambda *_: action())


def failed_step(model, gen, key: str) -> None:
    """A step expected to fail on this rank: report how, and how long it took."""
    start = time.monotonic()
    try:
        step(model, gen)
    except Exception as e:  # noqa: BLE001 - reported to the test
        spawned.report(key, {**spawned.describe(e), "seconds": time.monotonic() - start})
        return
    spawned.report(key, {"type": None, "seconds": time.monotonic() - start})


def _raise():
    raise ValueError("bad batch on rank 1")


def _kill_self():
    spawned.report("killed_at", time.monotonic())
    os.kill(os.getpid(), signal.SIGKILL)


def late_split(group, rank: int) -> None:
    """Rank 1 reaches parallelize 3 s after rank 0, whose limit is 1 s: report how each rank fails."""
    if rank == 1:
        time.sleep(3)
    start = time.monotonic()
    try:
        split(group, timeout=1)
    except Exception as e:  # noqa: BLE001 - reported to the test
        spawned.report("late", {**spawned.describe(e), "seconds": time.monotonic() - start})


def faults(rank: int) -> None:
    """Rank 0 meets five faults in turn, each on its own process group (a group is out of step after a
    fault); rank 1 causes four of them, rank 2 one."""
    late, stalled, raising, early, killed = (dist.new_group(ranks) for ranks in ([0, 1], [0, 1], [0, 1], [0, 2], [0, 1]))
    if rank in (0, 1):
        # 0. Rank 1 reaches parallelize after rank 0's limit.
        late_split(late, rank)
        # 1. Rank 1 is stuck in its own code, past the 2 s limit.
        model, gen = split(stalled), same_batches()
        # the 2 s limit once set up: parallelize's handshake waits for the slower rank under the limit in force
        model.tensorshard.comm.guard.set_timeout(2)
        spawned.report("shared memory", model.tensorshard.comm.guard.shm is not None)
        if rank == 1:
            before_b2(model, lambda: time.sleep(4))
        failed_step(model, gen, "stall")
        # 2. Rank 1 raises, and lives on (it goes to case 4): it is not its exit that stops rank 0.
        model, gen = split(raising, timeout=30), same_batches()
        step(model, gen)  # a good step first
        if rank == 1:
            before_b2(model, _raise)
        failed_step(model, gen, "raise")
    if rank in (0, 2):
        # 3. Rank 2's script ends early: its process exits normally while rank 0 goes on.
        model, gen = split(early), same_batches()
        step(model, gen)
        if rank == 2:
            spawned.report("pid", os.getpid())
            return
        failed_step(model, gen, "early")
    # 4. Rank 1 is killed (SIGKILL) in the third step; rank 0's error is uncaught and ends its process.
    model, gen = split(killed), same_batches()
    for i in range(4):
        if i == 2 and rank == 1:
            spawned.report("pid", os.getpid())
            before_b2(model, _kill_self)
        step(model, gen)
    spawned.report("finished", True)


@pytest.fixture(scope="module", params=["shared memory", "gloo"])
def result(request):
    """The scenario's outcome, with the collectives through each transport (TENSORSHARD_SHM=0: gloo)."""
    saved = os.environ.get("TENSORSHARD_SHM")
    os.environ["TENSORSHARD_SHM"] = "1" if request.param == "shared memory" else "0"  # the ranks inherit it
    try:
        out = spawned.run(faults, world=3)
    finally:
        if saved is None:
            del os.environ["TENSORSHARD_SHM"]
        else:
            os.environ["TENSORSHARD_SHM"] = saved
    assert out.events[0]["shared memory"] == (request.param == "shared memory")
    return out


def test_a_stalled_rank_times_out_the_others_naming_it(result):
    waiting, stalled = result.events[0]["stall"], result.events[1]["stall"]
    assert waiting["type"] == "TimeoutError"
    assert "all_reduce at b2 on rank 0" in waiting["message"], waiting["message"]
    assert "rank(s) [1] did not arrive within 2 s" in waiting["message"]
    assert "timeout=S" in waiting["message"] and "TENSORSHARD_TIMEOUT" in waiting["message"]
    assert 1.5 < waiting["seconds"] < 10
    # Once back, the stalled rank does not wait in vain either: it stops on rank 0's report (rank 0 is
    # alive, waiting for it in case 2).
    assert stalled["type"] == "CollectiveAborted", stalled
    assert "rank 0 gave up at all_reduce at b2" in stalled["message"]


def test_a_rank_late_to_parallelize_is_named_on_both_ranks(result):
    """The ranks' meeting in parallelize is bounded by the limit like a collective: the rank that waited names
    the late one and the fix, and the late one stops on arrival, naming the first (not torch's bare store
    "wait timeout")."""
    waiting, late = result.events[0]["late"], result.events[1]["late"]
    assert waiting["type"] == "TimeoutError", waiting
    assert "parallelize on rank 0" in waiting["message"] and "rank(s) [1] did not reach it within 1 s" in waiting["message"]
    assert "timeout=S" in waiting["message"] and "TENSORSHARD_TIMEOUT" in waiting["message"]
    assert waiting["seconds"] < 10
    assert late["type"] == "CollectiveAborted", late
    assert "rank 0 gave up at parallelize" in late["message"] and late["seconds"] < 5


def test_a_raising_rank_stops_the_others_naming_rank_and_operation(result):
    own, other = result.events[1]["raise"], result.events[0]["raise"]
    assert own["type"] == "ValueError" and own["message"] == "bad batch on rank 1"
    assert "raised on rank 1 of tensor-parallel group [0, 1] in the forward of TwoBlocks" in " ".join(own["notes"])
    assert other["type"] == "CollectiveAborted"
    assert "all_reduce at b2 on rank 0" in other["message"], other["message"]
    assert "rank 1 raised ValueError: bad batch on rank 1 in the forward of TwoBlocks" in other["message"]
    assert other["seconds"] < 5  # the limit was 30 s: rank 0 stopped on rank 1's report, not a timeout


def test_a_rank_that_exits_early_does_not_leave_the_others_waiting(result):
    error = result.events[0]["early"]
    assert error["type"] == "CollectiveAborted"
    # The next step's first collective: the input check (on the first 3 calls).
    assert "the input check of TwoBlocks on rank 0" in error["message"], error["message"]
    assert f"rank 2 is gone: its process {result.events[2]['pid']} ended" in error["message"]
    assert result.exit_codes[2] == 0 and error["time"] - result.exit_times[2] < 30


def test_killing_one_of_two_ranks_mid_step_ends_the_other_with_a_clear_error(result):
    assert result.exit_codes[:2] == [1, -signal.SIGKILL]
    assert "finished" not in result.events[0]
    error = result.events[0]["raised"]
    assert error["type"] == "CollectiveAborted"
    assert "all_reduce at b2 on rank 0" in error["message"], error["message"]
    assert f"rank 1 is gone: its process {result.events[1]['pid']} ended (killed, crashed or exited)" in error["message"]
    assert "end the job (torchrun restarts it with --max-restarts)" in error["message"]
    assert result.exit_times[0] - result.events[1]["killed_at"] < 30  # measured here: ~1-3 s


# --- the time limit ---------------------------------------------------------------------------------------------


def group_timeout(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def time_limits_task() -> list[float]:
    """The limit each way of setting it gives the tensor-parallel group (a fresh group per model)."""
    limits = []
    os.environ.pop("TENSORSHARD_TIMEOUT", None)
    for kwargs, env in (({}, None), ({}, "7"), ({"timeout": 12}, "7")):
        if env is not None:
            os.environ["TENSORSHARD_TIMEOUT"] = env  # the pool restores its environment after each task
        group = dist.new_group([0, 1])
        model = split(group, **kwargs)
        limits += [group_timeout(group), model.tensorshard.comm.guard.timeout]
    # tensor_parallel(distributed=True): the job's default group is the tensor-parallel group.
    world = dist.group.WORLD
    model = tp.tensor_parallel(TwoBlocks(), plan=plans.TWO_BLOCKS, distributed=True, timeout=20)
    limits += [group_timeout(world), model.tensorshard.comm.guard.timeout]
    model.tensorshard.comm.guard.set_timeout(PG_TIMEOUT)  # back to the pool's own limit for later tasks
    return limits


def test_the_time_limit_goes_into_the_process_group(pool2):
    """Default 300 s, else TENSORSHARD_TIMEOUT, else timeout=: set as the group's own timeout, so it also
    bounds collectives that are not tensorshard's (a gloo operation past it fails by itself)."""
    assert pool2.run(time_limits_task) == [[300.0, 300.0, 7.0, 7.0, 12.0, 12.0, 20.0, 20.0]] * 2


# --- under torchrun itself ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_kill_one_of_two_ranks_mid_step(tmp_path):
    """`torchrun --nproc_per_node=2`, rank 1 SIGKILLed inside a step: the job ends within 30 s, torchrun
    naming rank 1 and the signal; rank 0 never finishes its steps."""
    env = child_env(OMP_NUM_THREADS="1")
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         os.path.join(HERE, "scripts", "kill_mid_step.py")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=80,
    )
    ended = time.monotonic()
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    killed = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("rank 1 killing itself at")]
    assert killed and ended - killed[0] < 30, out[-3000:]
    assert "rank 0 finished" not in out
    assert "rank      : 1 (local_rank: 1)" in out and "Signal 9 (SIGKILL)" in out, out[-3000:]
