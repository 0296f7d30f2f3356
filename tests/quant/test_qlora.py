"""QLoRA: LoRA adapters on a split 4-bit model (in either order) train with the unsplit QLoRA's losses, and the
adapter saves in PEFT's format, loading into an unsplit 4-bit model with plain PEFT."""

from __future__ import annotations

import pytest
import torch

import tensorshard as tp
from support.helpers import rel_err, train_both_causal_lm
from support.quantized_models import load

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.timeout(120)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def qlora(model):
    torch.manual_seed(1)  # init_lora_weights=False: B is random too, so the adapter matters from the first step
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    return peft.get_peft_model(model, config)


def nf4(path):
    return load(path, 4, "nf4", True).train()  # NF4 with double quantization, as QLoRA


def train_both(model, ref, gen, steps: int = 3) -> list[tuple[float, float]]:
    return train_both_causal_lm(model, ref, [torch.randint(0, 128, (2, 9), generator=gen) for _ in range(steps)])


@pytest.mark.parametrize("n", [2, 3])
def test_qlora_then_split_trains_like_unsplit_and_saves_peft_format(llama_dir, gen, tmp_path, n):
    ref = qlora(nf4(llama_dir))
    model = tp.tensor_parallel(qlora(nf4(llama_dir)), ["cpu"] * n)
    lora_layer = model.module_shards[0].base_model.model.model.layers[0].self_attn.q_proj
    assert type(lora_layer).__module__ == "peft.tuners.lora.bnb"  # PEFT's QLoRA layer around a split Linear4bit
    assert type(lora_layer.base_layer.weight).__name__ == "Params4bit"
    for got, want in train_both(model, ref, gen):
        assert got == pytest.approx(want, rel=1e-4)
    model.save_pretrained(tmp_path / "adapter")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 384)  # unsplit shapes
    assert not any("base_layer" in k for k in saved)  # the adapter alone: no quantized weight in it
    loaded = peft.PeftModel.from_pretrained(nf4(llama_dir), tmp_path / "adapter").eval()
    ids = torch.randint(0, 128, (2, 9), generator=gen)
    with torch.no_grad():
        assert rel_err(loaded(input_ids=ids).logits, ref.eval()(input_ids=ids).logits) < 1e-4


def test_split_then_qlora_trains_like_unsplit(llama_dir, gen, tmp_path):
    model = qlora(tp.tensor_parallel(nf4(llama_dir), ["cpu"] * 2, sharded=False))
    model.save_pretrained(tmp_path / "adapter")  # the starting adapter, in PEFT's format, for the unsplit reference
    ref = peft.PeftModel.from_pretrained(nf4(llama_dir), tmp_path / "adapter", is_trainable=True)
    for got, want in train_both(model, ref, gen):
        assert got == pytest.approx(want, rel=1e-4)


def test_qlora_disables_its_adapter_but_refuses_to_merge_into_quantized_slices(llama_dir, gen):
    ref = qlora(nf4(llama_dir)).eval()
    model = tp.tensor_parallel(qlora(nf4(llama_dir)), ["cpu"] * 2).eval()
    ids = torch.randint(0, 128, (2, 9), generator=gen)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with model.disable_adapter(), ref.disable_adapter():  # the 4-bit base model, on every device
            assert rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-5
        with pytest.raises(NotImplementedError, match="quantized"):
            model.merge_adapter()  # it would requantize each device's slice
        assert torch.equal(model(input_ids=ids).logits, before)
