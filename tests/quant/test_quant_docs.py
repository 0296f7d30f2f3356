"""The examples of docs/quantization.md run as written (checked on the run of tests/test_docs_snippets.py), and
the command it shows prints the memory it quotes."""

from pathlib import Path

import pytest

from support.docs import docs_runs, python_blocks

pytestmark = pytest.mark.timeout(450)  # the first test to ask runs every doc once (support.docs.docs_runs)

DOC = Path(__file__).resolve().parents[2] / "docs" / "quantization.md"


def test_quantization_doc_examples_run(monkeypatch, capsys):
    assert len(python_blocks(DOC)) == 4
    run = docs_runs()["docs/quantization.md"]
    assert not run.errors, run.errors[0]
    assert "Params4bit torch.Size([128, 192])" in run.printed
    assert (run.folder / "qlora-adapter" / "adapter_model.safetensors").exists()  # the last block: QLoRA
    monkeypatch.chdir(run.folder)  # the doc saved "tiny-llama" in its working folder

    from tensorshard.cli import main

    assert main(["plan", "tiny-llama", "--devices", "3", "--quantize", "nf4"]) == 0
    assert "190.8 KiB | 190.8 KiB | 189.2 KiB (whole model: 561.2 KiB" in capsys.readouterr().out
