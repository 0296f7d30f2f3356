"""`tensorshard plan` with what users type (docs/errors.md, class 10): a GGUF file, module:function from the
current folder, a mistyped model type, and the memory estimate of a model with tied embeddings."""

import copy
import sys

import pytest
import torch

import tensorshard as tp
from tensorshard.cli import main
from support.tiny_gguf import write_gguf
from tensorshard.plans.explain import explain

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)


def tiny_llama(tied: bool = False):
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_plan_of_a_gguf_file(tmp_path, capsys):
    path = write_gguf(tiny_llama(), tmp_path / "tiny.gguf")
    assert main(["plan", str(path), "--devices", "2"]) == 0  # before: UnicodeDecodeError
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "model.layers.*.self_attn.q_proj" in out


def test_module_function_resolves_from_the_current_folder(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_models_cwd.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])  # as a console script
    assert main(["plan", "my_models_cwd:build", "--devices", "2"]) == 0
    assert "ColwiseParallel" in capsys.readouterr().out


def test_a_mistyped_model_type_names_the_closest_few():
    with pytest.raises(SystemExit) as info:
        main(["plan", "lama", "--devices", "2"])
    message = str(info.value)
    assert "closest model types: llama," in message
    assert len(message) < 300  # before: every one of ~900 model types


@pytest.mark.parametrize("tied", [True, False])
def test_the_memory_estimate_is_what_the_split_holds(tied):
    model = tiny_llama(tied)
    estimate = explain(model, tp.preset_for(model), 2).bytes_per_device
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * 2)
    buffers = [sum(b.numel() * b.element_size() for b in s.buffers()) for s in split.module_shards]
    held = [m - b for m, b in zip(split.memory_per_device().values(), buffers)]
    explained_buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert [e - explained_buffers for e in estimate] == held  # before, tied: the embedding counted twice
