import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # two cores: keep the simulated devices from fighting over threads


@pytest.fixture
def gen() -> torch.Generator:
    """A private generator for test data (shards run in threads; the global seed is shared)."""
    return torch.Generator().manual_seed(1234)
