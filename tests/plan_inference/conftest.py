import pytest
import torch


@pytest.fixture(autouse=True)
def fixed_weights():
    """Models here are built with the global generator (before any shard thread runs): seed it, so a test
    does not depend on which tests ran before it."""
    torch.manual_seed(0)
