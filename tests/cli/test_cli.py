"""`tensorshard plan`: models built on the meta device, the table, and plans written as JSON."""

import json

import pytest

import tensorshard as tp
from tensorshard.cli import main

pytestmark = pytest.mark.timeout(180)


def test_plan_llama_over_4_devices(tmp_path, capsys):
    path = tmp_path / "llama.json"
    assert main(["plan", "llama", "--devices", "4", "--json", str(path)]) == 0  # the default 7B config, on meta
    out = capsys.readouterr().out
    assert "model.layers.*.self_attn.q_proj" in out and "ColwiseParallel(blocks=('q',))" in out
    assert "weight (1024, 4096)" in out  # q_proj's local shape on each of 4 devices
    # per token: embedding + 2 per block forward; 2 per block + the head's input backward (32 blocks)
    assert "forward: 65 x all_reduce" in out and "1 x all_gather" in out and "backward: 65 x all_reduce" in out
    assert "25% on the largest device" in out
    plan = tp.Plan.load(path)
    assert plan["model.layers.*.self_attn"].num_heads == 32
    assert plan["model.layers.*.mlp.down_proj"] == tp.RowwiseParallel()
    assert json.loads(path.read_text())["format"] == "tensorshard.plan/1"


def test_plan_from_config_json_module_function_and_edited_plan(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 96,
    }))
    path = tmp_path / "plan.json"
    assert main(["plan", str(config), "--devices", "3", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "weight (59|59|58, 64)" in out  # 176 MLP features on 3 devices

    edited = tp.Plan({k: v for k, v in tp.Plan.load(path).items() if "mlp" not in k})
    edited.save(path)
    assert main(["plan", str(config), "--devices", "3", "--plan", str(path), "--expand"]) == 0
    out = capsys.readouterr().out
    assert "plan file" in out and "model.layers.0.mlp.up_proj" in out and "weight (176, 64)" in out  # now whole

    assert main(["plan", "support.custom_models:build_mixer", "--devices", "2"]) == 0
    assert "blocks.*.token_fc1" in capsys.readouterr().out


def test_plan_explains_bad_model_names():
    with pytest.raises(SystemExit, match="not a transformers model type"):
        main(["plan", "no_such_model", "--devices", "2"])
    with pytest.raises(SystemExit, match="cannot import"):
        main(["plan", "no_such_module:build", "--devices", "2"])
    with pytest.raises(SystemExit, match="no such file"):
        main(["plan", "missing/config.json", "--devices", "2"])


def test_plan_explains_a_convnet_and_a_speech_model(tmp_path, capsys):
    """A ResNet (BatchNorm split with its convolution's channels) and Whisper (the encoder-decoder with its
    head, not the decoder-only class): both from small config files, on the meta device."""
    resnet = tmp_path / "resnet.json"
    resnet.write_text(json.dumps({"model_type": "resnet", "embedding_size": 16, "hidden_sizes": [32, 64],
                                  "depths": [1, 1], "layer_type": "bottleneck"}))
    assert main(["plan", str(resnet), "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "BatchNorm2d" in out and "ChannelParallel()" in out and "running_var (" in out
    whisper = tmp_path / "whisper.json"
    whisper.write_text(json.dumps({"model_type": "whisper", "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
                                   "encoder_attention_heads": 4, "decoder_attention_heads": 4, "vocab_size": 96,
                                   "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_mel_bins": 16,
                                   "max_source_positions": 20, "pad_token_id": 0, "bos_token_id": 1,
                                   "eos_token_id": 2, "decoder_start_token_id": 3}))
    path = tmp_path / "whisper-plan.json"
    assert main(["plan", str(whisper), "--devices", "2", "--json", str(path)]) == 0
    assert "WhisperForConditionalGeneration" in capsys.readouterr().out
    plan = tp.Plan.load(path)
    for attention in ("model.encoder.layers.*.self_attn", "model.decoder.layers.*.encoder_attn"):
        assert plan[attention].num_heads == 4
    assert plan["model.encoder.layers.*.fc1"] == tp.ColwiseParallel()
    assert plan["proj_out"] == tp.ColwiseParallel(gather_output=True)
