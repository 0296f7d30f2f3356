"""The examples of docs/quantization.md run as written (```python blocks, in order, one namespace), and the
command it shows prints the memory it quotes."""

from pathlib import Path

import pytest

from support.docs import python_blocks, run_python_blocks

pytestmark = pytest.mark.timeout(120)

DOC = Path(__file__).resolve().parents[2] / "docs" / "quantization.md"


def test_quantization_doc_examples_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the doc saves "tiny-llama" in the working directory
    blocks = python_blocks(DOC)
    assert len(blocks) == 4
    namespace = run_python_blocks(DOC, blocks)
    printed = capsys.readouterr().out
    assert "Params4bit torch.Size([128, 192])" in printed
    assert namespace["model"].world_size == 2  # the last block: QLoRA over 2 devices
    assert (tmp_path / "qlora-adapter" / "adapter_model.safetensors").exists()

    from tensorshard.cli import main

    assert main(["plan", "tiny-llama", "--devices", "3", "--quantize", "nf4"]) == 0
    assert "190.8 KiB | 190.8 KiB | 189.2 KiB (whole model: 561.2 KiB" in capsys.readouterr().out
