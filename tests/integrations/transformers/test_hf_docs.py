"""The examples of docs/transformers.md run as written (```python blocks, in order, one namespace)."""

import re

import pytest

from tensorshard.plans.presets import PRESETS
from support import ROOT

pytestmark = pytest.mark.timeout(120)

DOC = ROOT / "docs" / "transformers.md"


def test_transformers_doc_examples_run(capsys):
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    assert len(blocks) >= 5
    saved = dict(PRESETS)
    try:
        namespace: dict = {}
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), namespace)
    finally:  # the doc registers a starcoder2 preset; other tests expect the translated plan
        PRESETS.clear()
        PRESETS.update(saved)
    printed = capsys.readouterr().out
    assert "TensorParallelLlamaForCausalLM cpu torch.float32" in printed
    assert "ShardedDynamicCache 7" in printed and "[2, 1]" in printed
