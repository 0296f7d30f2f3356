"""The examples of docs/finetuning.md run as written (```python blocks, in order, one namespace)."""

import re

import pytest

from support import ROOT

pytestmark = pytest.mark.timeout(120)

DOC = ROOT / "docs" / "finetuning.md"


def test_finetuning_doc_examples_run(capsys):
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    assert len(blocks) >= 6
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    losses = [line.split()[-1] for line in printed if line.startswith(("TensorParallelPeftModel", "PeftModel "))]
    assert len(losses) == 2 and abs(float(losses[0]) - float(losses[1])) <= 1e-4 * float(losses[1])
    assert any(line.startswith("True [") for line in printed)  # the Trainer: split == unsplit == resumed
    assert "5 torch.Size([1, 7])" in printed
