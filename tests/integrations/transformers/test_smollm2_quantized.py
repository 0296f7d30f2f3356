"""SmolLM2-135M-Instruct in 4-bit (NF4), quantized while loading, split over 2 and 3 devices: the demo
prompt's answer is token-identical to transformers' own unsplit 4-bit model of the same weights."""

import copy

import pytest
import torch

import tensorshard as tp
from support.quantized_models import float_kernel
from tensorshard import demo

pytestmark = pytest.mark.timeout(400)
bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def smollm2_folder(smollm2, tmp_path_factory):
    """The demo's model as a safetensors folder (the GGUF file holds it quantized its own way)."""
    from safetensors.torch import save_model

    model, _ = smollm2
    folder = tmp_path_factory.mktemp("smollm2")
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):  # transformers marks GGUF-loaded models (5.0 does not);
        del config.quantization_config  # the weights are float32
    config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"))  # tied embedding / lm_head stored once
    return folder


def test_4bit_smollm2_answers_the_demo_prompt_split_over_2_and_3(smollm2, smollm2_folder):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    _, tokenizer = smollm2
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    ids = demo.chat_ids(tokenizer, "Name three colors.")
    generate = dict(max_new_tokens=12, do_sample=False)
    ref = float_kernel(AutoModelForCausalLM.from_pretrained(smollm2_folder, quantization_config=config, device_map="cpu").eval())
    expected = ref.generate(ids, **generate)
    answer = tokenizer.decode(expected[0, ids.shape[1]:])
    assert len(answer.split()) >= 3  # a real answer (NF4 changes it from the float model's "1. Red ...")
    for n in (2, 3):
        model = tp.from_pretrained(smollm2_folder, ["cpu"] * n, quantization_config=config, progress=False)
        assert torch.equal(model.generate(ids, **generate), expected), n
        q_proj = model.module_shards[-1].model.layers[0].self_attn.q_proj.weight
        # the last device holds 3 query heads of 64 at 2 devices (6 + 3) and at 3 (3 + 3 + 3), packed 4-bit
        assert isinstance(q_proj, bnb.nn.Params4bit) and tuple(q_proj.quant_state.shape) == (3 * 64, 576)
