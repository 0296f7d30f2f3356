"""The examples of docs/finetuning.md run as written (```python blocks, in order, one namespace)."""

import pytest

from support import ROOT
from support.docs import python_blocks, run_python_blocks

pytestmark = pytest.mark.timeout(120)

DOC = ROOT / "docs" / "finetuning.md"


def test_finetuning_doc_examples_run(capsys):
    blocks = python_blocks(DOC)
    assert len(blocks) >= 6
    run_python_blocks(DOC, blocks)
    printed = capsys.readouterr().out.splitlines()
    losses = [line.split()[-1] for line in printed if line.startswith(("TensorParallelPeftModel", "PeftModel "))]
    assert len(losses) == 2 and abs(float(losses[0]) - float(losses[1])) <= 1e-4 * float(losses[1])
    assert any(line.startswith("True [") for line in printed)  # the Trainer: split == unsplit == resumed
    assert "5 torch.Size([1, 7])" in printed
