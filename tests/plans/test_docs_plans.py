"""The README's first example and every example of docs/plans.md run as written, with the results they state
(checked on the run of tests/test_docs_snippets.py, which fails on a block's error)."""

import re

import pytest

from support.docs import docs_runs

pytestmark = pytest.mark.timeout(450)  # the first test to ask runs every doc once (support.docs.docs_runs)


def test_readme_one_line_example_runs():
    run = docs_runs()["README.md"]
    assert not run.errors, run.errors[0]
    assert "ColwiseParallel()" in run.printed and "RowwiseParallel()" in run.printed
    # 33,088 fp32 parameters, half on each device: the split weights and biases, and (train mode: ZeRO-3) the
    # row-parallel bias of 64 too
    assert "{'cpu[0]': 66176, 'cpu[1]': 66176}" in run.printed


def test_plans_doc_examples_run():
    run = docs_runs()["docs/plans.md"]
    assert not run.errors, run.errors[0]
    assert (run.folder / "my_plan.json").exists()
    # the first block prints the largest difference between the split model's logits and the unsplit one's
    assert float(re.search(r"^tensor\(([-0-9.e]+)", run.printed, flags=re.M).group(1)) < 1e-5
    assert "[4, 3, 3]" in run.printed and "((0, 6), (6, 9)) ((0, 2), (2, 3))" in run.printed
