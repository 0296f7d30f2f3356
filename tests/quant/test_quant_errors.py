"""What a quantized model cannot do is refused before it changes, with the fix in the message."""

from __future__ import annotations

import sys

import pytest
import torch

import tensorshard as tp
from support.helpers import rel_err
from support.quantized_models import load

pytestmark = pytest.mark.timeout(120)


def test_split_through_a_block_is_refused(unaligned_dir, gen):
    """An MLP width of 88 at 2 devices: gate_proj's first slice ends at row 44, value 44 * 72 = 3168, inside a
    block of 64. Refused by name before anything moves; the model still runs as before."""
    model = load(unaligned_dir, 4, "nf4", True)
    ids = torch.randint(0, 128, (1, 5), generator=gen)
    with torch.no_grad():
        before = model(ids).logits
    plan = tp.Plan({"model.layers.*.mlp.gate_proj": tp.ColwiseParallel(gather_output=True)})
    with pytest.raises(ValueError, match=r"gate_proj: splitting this 4-bit weight \(88x72, quantized in blocks of 64 "
                                         r"values\) by output rows over 2 devices cuts a quantization block: device 0's "
                                         r"slice 0:44 has an edge at 44 .*Replicate\(\) in the plan"):
        tp.tensor_parallel(model, ["cpu"] * 2, plan=plan)
    with torch.no_grad():
        assert rel_err(model(ids).logits, before) == 0


def test_row_split_needs_whole_blocks_per_row(unaligned_dir):
    """The suite's usual tiny Llama (72 features, 9 heads of 8): o_proj reads 72 features, not a multiple of
    64, so its blocks span two rows and no device count can split it by input features."""
    model = load(unaligned_dir, 4, "fp4", False)
    with pytest.raises(ValueError, match=r"o_proj: a 4-bit weight of 72x72 .* cannot be split by input features at "
                                         r"any device count: 72 is not a multiple of 64"):
        tp.tensor_parallel(model, ["cpu"] * 2)


def test_without_bitsandbytes_names_the_extra(llama_dir, monkeypatch):
    """The issue's 4-bit model was refused with a message about `blocks=`; without bitsandbytes importable,
    a quantized model is refused with the extra that installs it."""
    model = load(llama_dir, 4)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes now raises ImportError
    with pytest.raises(ImportError, match=r"needs bitsandbytes, which is not installed: pip install 'tensorshard\[quant\]'"):
        tp.tensor_parallel(model, ["cpu"] * 2)


def test_torchrun_engine_refuses_quantized(llama_dir):
    model = load(llama_dir, 8)
    with pytest.raises(NotImplementedError, match=r"torchrun engine \(DTensor\) cannot hold quantized weights"):
        tp.parallelize(model, None)  # refused before the mesh is looked at


@pytest.mark.parametrize("save", ["save_sharded", "save_gathered", "save_pretrained"])
def test_checkpoints_of_split_quantized_models_are_refused(llama_dir, tmp_path, save):
    """Packed slices and their quantization state are not what tensorshard's checkpoints hold: refused by
    name, pointing to loading the full-precision checkpoint quantized instead; nothing is written."""
    model = tp.tensor_parallel(load(llama_dir, 4), ["cpu"] * 2)
    target = tmp_path / "out"
    with pytest.raises(NotImplementedError, match=r"is a bitsandbytes quantized weight: tensorshard.s checkpoints .* "
                                                  r"tp.from_pretrained\(path, devices, quantization_config=...\)"):
        model.save_pretrained(target) if save == "save_pretrained" else getattr(tp, save)(model, target)
    assert not target.exists()


def test_loading_a_checkpoint_into_a_split_quantized_model_is_refused(llama_dir, tmp_path, gen):
    """A full-precision sharded checkpoint would be copied over the packed codes: refused before reading."""
    tp.save_sharded(tp.tensor_parallel(load(llama_dir, None), ["cpu"] * 2), tmp_path / "ckpt")
    model = tp.tensor_parallel(load(llama_dir, 4), ["cpu"] * 2)
    ids = torch.randint(0, 128, (1, 5), generator=gen)
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(NotImplementedError, match=r"model.layers.0.self_attn.q_proj.weight is a bitsandbytes quantized weight"):
        tp.load_sharded(model, tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
