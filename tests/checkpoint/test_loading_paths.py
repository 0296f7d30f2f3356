"""Docs and loading, class 11: a save_sharded folder of a transformers model carries its config.json (so
tp.from_pretrained needs no model=), and a GGUF file's metadata is parsed once, with progress from the start."""

import copy
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tensorshard as tp
from support.helpers import rel_err

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_a_sharded_folder_loads_without_model(tmp_path, gen):
    ref = tiny_llama()
    split = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2)
    tp.save_sharded(split, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "config.json").exists()
    loaded = tp.from_pretrained(tmp_path / "ckpt", ["cpu"] * 3)  # before: "has no config.json ... pass model="
    ids = torch.randint(0, 96, (2, 6), generator=gen)
    with torch.no_grad():
        assert rel_err(loaded(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-5


def test_a_gguf_file_is_parsed_once_with_progress_from_the_start(tmp_path, gen, monkeypatch, capsys):
    gguf = pytest.importorskip("gguf")
    from support.tiny_gguf import write_gguf

    ref = tiny_llama()
    path = write_gguf(ref, tmp_path / "tiny.gguf")
    opened = []
    real = gguf.GGUFReader

    def counting_reader(*args, **kwargs):  # the real reader; we only count how often the header is parsed
        opened.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    loaded = tp.from_pretrained(path, ["cpu"] * 2, progress=True)
    assert len(opened) == 1  # before: twice (the config, then the tensors)
    assert "reading the GGUF header of tiny.gguf" in capsys.readouterr().err
    ids = torch.randint(0, 96, (2, 6), generator=gen)
    with torch.no_grad():
        assert rel_err(loaded(input_ids=ids).logits, ref(input_ids=ids).logits) < 0.05  # Q8_0 projections


def test_a_gguf_file_loads_in_a_fresh_process(tmp_path):
    """What a user's script does: `import tensorshard` and load, with nothing of transformers imported before
    (the GGUF helpers module is not an attribute of transformers' lazy module then)."""
    from support.tiny_gguf import write_gguf

    path = write_gguf(tiny_llama(), tmp_path / "tiny.gguf")
    code = f"import tensorshard as tp; m = tp.from_pretrained({str(path)!r}, ['cpu'] * 2, progress=False); print(type(m).__name__)"
    src = Path(__file__).resolve().parents[2] / "src"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                          env=dict(os.environ, PYTHONPATH=str(src)))
    assert done.returncode == 0, done.stderr[-3000:]  # before: AttributeError ... no attribute modeling_gguf_pytorch_utils
    assert "TensorParallelLlamaForCausalLM" in done.stdout
