"""The examples of docs/finetuning.md run as written, with the results they state (checked on the run of
tests/test_docs_snippets.py: each block on its own or after the one it continues)."""

import pytest

from support import ROOT
from support.docs import docs_runs, python_blocks

pytestmark = pytest.mark.timeout(450)  # the first test to ask runs every doc once (support.docs.docs_runs)

DOC = ROOT / "docs" / "finetuning.md"


def test_finetuning_doc_examples_run():
    assert len(python_blocks(DOC)) >= 6
    run = docs_runs()["docs/finetuning.md"]
    assert not run.errors, run.errors[0]
    printed = run.printed.splitlines()
    losses = [line.split()[-1] for line in printed if line.startswith(("TensorParallelPeftModel", "PeftModel "))]
    assert len(losses) == 2 and abs(float(losses[0]) - float(losses[1])) <= 1e-4 * float(losses[1])
    assert any(line.startswith("True [") for line in printed)  # the Trainer: split == unsplit == resumed
    assert "5 torch.Size([1, 7])" in printed
