"""Fixtures of the whole suite: a private random generator, and the session's torchrun process pools.

The pools (tests/distributed/harness.py) are gloo process groups of 2, 3 or 4 ranks, spawned once, when a
test first asks for one, and shared by every folder: tests/distributed, tests/checkpoint (3 ranks: uneven
splits such as 59/59/58 features) and tests/reliability. Fault tests that end a rank spawn their own.
"""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "distributed"))  # the harness, and helpers its workers import
torch.set_num_threads(1)  # two cores: keep the simulated devices from fighting over threads

from harness import shared_pool  # noqa: E402


@pytest.fixture
def gen() -> torch.Generator:
    """A private generator for test data (shards run in threads; the global seed is shared)."""
    return torch.Generator().manual_seed(1234)


def _pool(world: int):
    pool = shared_pool(world)
    yield pool
    pool.stop()


@pytest.fixture(scope="session")
def pool2():
    yield from _pool(2)


@pytest.fixture(scope="session")
def pool3():
    yield from _pool(3)


@pytest.fixture(scope="session")
def pool4():
    yield from _pool(4)
