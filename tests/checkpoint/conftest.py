"""Process pools for the torchrun checkpoint tests: the session's pools of tests/distributed (2 and 4
ranks, the same processes) and one of 3 ranks (uneven splits: 59/59/58 features, 3/3/2 heads)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "distributed"))

from harness import shared_pool  # noqa: E402


@pytest.fixture(scope="session")
def pool2():
    pool = shared_pool(2)
    yield pool
    pool.stop()


@pytest.fixture(scope="session")
def pool3():
    pool = shared_pool(3)
    yield pool
    pool.stop()


@pytest.fixture(scope="session")
def pool4():
    pool = shared_pool(4)
    yield pool
    pool.stop()
