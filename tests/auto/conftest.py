import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def fixed_weights():
    """Models here are built with the global generator (before any shard thread runs): seed it, so a test
    does not depend on which tests ran before it."""
    torch.manual_seed(0)
