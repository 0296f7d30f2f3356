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


def test_a_balanced_estimate_is_what_the_balanced_split_holds(capsys):
    """3 KV heads over 2 devices: `balance=True` resizes each block's MLP, and the estimate (and `tensorshard plan
    --balance`) shows those sizes and the memory the balanced split holds."""
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=144, intermediate_size=384, num_hidden_layers=2, num_attention_heads=9,
        num_key_value_heads=3,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    even, balanced = (explain(model, tp.preset_for(model), 2, balance=b) for b in (False, True))
    split = tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * 2, balance=True)
    buffers = [sum(b.numel() * b.element_size() for b in s.buffers()) for s in split.module_shards]
    held = [m - b for m, b in zip(split.memory_per_device().values(), buffers)]
    explained_buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert [e - explained_buffers for e in balanced.bytes_per_device] == held
    assert balanced.bytes_per_device != even.bytes_per_device
    gate = split.module_shards[0].model.layers[0].mlp.gate_proj.weight.shape[0]
    row = next(r for r in balanced.rows if r.name == "model.layers.0.mlp.gate_proj")
    assert row.shapes == [f"weight ({gate}|{384 - gate}, 144)"], row.shapes


def test_a_checkpoint_folder_and_its_weights_file_explain_the_class_the_checkpoint_names(tmp_path, capsys):
    config = transformers.ViTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                                    image_size=32, patch_size=8, num_labels=5)
    torch.manual_seed(0)
    transformers.ViTForImageClassification(config).save_pretrained(tmp_path / "vit")
    for spec in (tmp_path / "vit", tmp_path / "vit" / "model.safetensors"):  # before: ViTModel; UnicodeDecodeError
        assert main(["plan", str(spec), "--devices", "2"]) == 0
        out = capsys.readouterr().out
        assert "ViTForImageClassification" in out and "classifier" in out, out
    (tmp_path / "lone.safetensors").write_bytes(b"\x90\x00")
    (tmp_path / "notes.json").write_bytes(b"\x90\x00 not json")
    with pytest.raises(SystemExit, match="without its folder's config.json"):
        main(["plan", str(tmp_path / "lone.safetensors"), "--devices", "2"])
    with pytest.raises(SystemExit, match="not a config.json"):
        main(["plan", str(tmp_path / "notes.json"), "--devices", "2"])
