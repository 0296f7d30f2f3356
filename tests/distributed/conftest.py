"""The torchrun-engine tests use the process pools `pool2` and `pool4` of tests/conftest.py (harness.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
