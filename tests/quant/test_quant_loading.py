"""tp.from_pretrained(path, devices, quantization_config=...): bitsandbytes layers in the empty model, each
device's slices quantized on that device as they are read."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch

import tensorshard as tp
from support.helpers import rel_err
from support.quantized_models import load, quant_config, quantized_layer_bytes, random_ids

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_load_equals_transformers_quantized(llama_dir, gen, quant_type, n):
    """Blocks stay whole, so quantizing a device's slice gives the slice of the whole quantized weight: the
    logits of transformers' own 4-bit load to float32 rounding, and a third (half) of its quantized bytes."""
    model = tp.from_pretrained(llama_dir, ["cpu"] * n, quantization_config=quant_config(4, quant_type), progress=False)
    ref = load(llama_dir, 4, quant_type)
    ids = random_ids(gen)
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref(ids).logits) < 1e-4
    gate = model.module_shards[0].model.layers[1].mlp.gate_proj
    assert isinstance(gate.weight, bnb.nn.Params4bit) and tuple(gate.weight.quant_state.shape) == (384 // n, 192)
    assert gate.quant_state is gate.weight.quant_state
    if n == 3:  # every split even
        for shard in model.module_shards:
            assert quantized_layer_bytes(shard) == pytest.approx(quantized_layer_bytes(ref) / 3, rel=0.005)


def test_4bit_double_quantization_load(llama_dir, gen):
    """Double quantization is done per device, on its own absmax values (their 256-blocks and offset are the
    device's own), so the nested state stays nested and the logits are as close to the full-precision
    model's as those of transformers' double-quantized load."""
    model = tp.from_pretrained(llama_dir, ["cpu"] * 2, quantization_config=quant_config(4, "nf4", True), progress=False)
    ids = random_ids(gen)
    with torch.no_grad():
        full = load(llama_dir, None)(ids).logits
        own_error = rel_err(load(llama_dir, 4, "nf4", True)(ids).logits, full)
        assert rel_err(model(ids).logits, full) < 1.2 * own_error
    for shard in model.module_shards:
        assert shard.model.layers[0].self_attn.o_proj.weight.quant_state.nested


def test_8bit_load_within_quantization_error(llama_dir, gen):
    model = tp.from_pretrained(llama_dir, ["cpu"] * 3, quantization_config=quant_config(8), progress=False)
    ids = random_ids(gen)
    with torch.no_grad():
        full = load(llama_dir, None)(ids).logits
        own_error = rel_err(load(llama_dir, 8)(ids).logits, full)
        assert rel_err(model(ids).logits, full) < 1.5 * own_error
    down = model.module_shards[2].model.layers[0].mlp.down_proj.weight
    assert isinstance(down, bnb.nn.Int8Params) and down.dtype == torch.int8 and tuple(down.shape) == (192, 128)


def test_quantization_config_is_checked_first(llama_dir):
    with pytest.raises(TypeError, match="quantization_config must be a transformers BitsAndBytesConfig"):
        tp.from_pretrained(llama_dir, ["cpu"] * 2, quantization_config={"load_in_4bit": True})
    with pytest.raises(NotImplementedError, match="torchrun engine \\(DTensor\\) cannot hold quantized weights"):
        tp.from_pretrained(llama_dir, mesh=object(), quantization_config=quant_config(4))


def test_plan_cli_shows_quantized_memory(llama_dir, capsys):
    """`tensorshard plan PATH --quantize nf4` counts what each device will hold: the bytes memory_per_device
    reports once the model is loaded that way (built on the meta device, nothing quantized)."""
    from tensorshard.cli import main
    from tensorshard.plans.explain import human_bytes

    assert main(["plan", llama_dir, "--devices", "3", "--quantize", "nf4"]) == 0
    out = capsys.readouterr().out
    assert "Linear4bit" in out and "weight (128, 192)" in out  # gate_proj's logical local shape
    model = tp.from_pretrained(llama_dir, ["cpu"] * 3, quantization_config=quant_config(4), progress=False)
    loaded = " | ".join(human_bytes(b) for b in model.memory_per_device().values())
    assert f"parameters per device: {loaded} " in out
    with pytest.raises(SystemExit, match="--quantize int4: use nf4, fp4, nf4-double, fp4-double or int8"):
        main(["plan", llama_dir, "--quantize", "int4"])
