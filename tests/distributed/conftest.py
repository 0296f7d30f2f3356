"""Process pools for the torchrun-engine tests: 2 and 4 gloo ranks, spawned once per session."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import Pool  # noqa: E402


@pytest.fixture(scope="session")
def pool2():
    pool = Pool(2)
    yield pool
    pool.stop()


@pytest.fixture(scope="session")
def pool4():
    pool = Pool(4)
    yield pool
    pool.stop()
