"""The process pool itself: a task that fails on one rank is reported with its traceback, the ranks left
waiting in a collective do not hang the test, and the next task gets a fresh pool."""

import time

import pytest
import torch
import torch.distributed as dist

from support.harness import RankFailure

pytestmark = pytest.mark.timeout(120)


def fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("failing on purpose")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that never comes


def ranks() -> int:
    return dist.get_rank()


def test_a_failing_rank_is_reported_and_the_pool_restarts(pool2):
    start = time.monotonic()
    with pytest.raises(RankFailure, match="(?s)rank 1.*failing on purpose"):
        pool2.run(fail_on_rank_one)
    assert time.monotonic() - start < 15  # not the process-group timeout
    assert pool2.procs is None  # torn down
    assert pool2.run(ranks) == [0, 1]  # and started afresh
