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
