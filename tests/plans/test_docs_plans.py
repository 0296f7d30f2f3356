"""The README's first example and every example of docs/plans.md run as written, with the results they state."""

import re
from pathlib import Path

import pytest
import torch

from support import ROOT

pytestmark = pytest.mark.timeout(120)


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def test_readme_one_line_example_runs(capsys):
    exec(compile(python_blocks(ROOT / "README.md")[0], "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "ColwiseParallel()" in printed and "RowwiseParallel()" in printed
    # 33,088 fp32 parameters, half on each device: the split weights and biases, and (train mode: ZeRO-3) the
    # row-parallel bias of 64 too
    assert "{'cpu[0]': 66176, 'cpu[1]': 66176}" in printed


def test_plans_doc_examples_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the doc saves my_plan.json
    namespace: dict = {}
    for block in python_blocks(ROOT / "docs" / "plans.md"):
        exec(compile(block, "docs/plans.md", "exec"), namespace)
    assert (tmp_path / "my_plan.json").exists()
    with torch.no_grad():
        assert float((namespace["model"](namespace["ids"]) - namespace["ref"](namespace["ids"])).abs().max()) < 1e-5
    printed = capsys.readouterr().out
    assert "[4, 3, 3]" in printed and "((0, 6), (6, 9)) ((0, 2), (2, 3))" in printed
