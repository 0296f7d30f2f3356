"""Process pools for the torchrun-engine tests: 2 and 4 gloo ranks, spawned once per session."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import shared_pool  # noqa: E402


@pytest.fixture(scope="session")
def pool2():
    pool = shared_pool(2)  # tests/checkpoint uses the same processes
    yield pool
    pool.stop()


@pytest.fixture(scope="session")
def pool4():
    pool = shared_pool(4)
    yield pool
    pool.stop()
