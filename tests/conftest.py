import os
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "distributed"))  # the process-pool harness, shared with tests/reliability
torch.set_num_threads(1)  # two cores: keep the simulated devices from fighting over threads

from harness import Pool  # noqa: E402


@pytest.fixture
def gen() -> torch.Generator:
    """A private generator for test data (shards run in threads; the global seed is shared)."""
    return torch.Generator().manual_seed(1234)


# Process pools for the torchrun-engine tests (tests/distributed, tests/reliability): 2 and 4 gloo ranks,
# spawned once per session, on first use.


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
