"""The examples of docs/migrating.md run as written (```python blocks, in order, one namespace)."""

import re
from pathlib import Path

import pytest

from support.docs import python_blocks, run_python_blocks

pytestmark = pytest.mark.timeout(120)

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"


def test_migrating_doc_examples_run(capsys):
    blocks = python_blocks(DOC)
    assert len(blocks) >= 5
    run_python_blocks(DOC, blocks)
    printed = capsys.readouterr().out
    assert "TensorParallelOPTForCausalLM True" in printed
    assert re.search(r"fc1\s+ColwiseParallel\(\)\nfc2\s+RowwiseParallel\(\)", printed)
    assert "no output rule 'sum' covers it" in printed
