"""The session's 2-rank process pool of tests/distributed (the same processes), for the torchrun and
Lightning bad-input tests. Fault tests that end a rank spawn their own processes (spawned.py)."""

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
