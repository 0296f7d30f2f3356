"""bitsandbytes' CUDA kernels on split 4-bit and 8-bit layers: the tiny Llamas of support/quantized_models.py
(4-bit blocks kept whole at 2 and 3 devices), quantized once on the CPU as transformers loads them, split over
lists with the GPU, against the unsplit quantized model moved to the GPU; QLoRA training; from_pretrained
quantizing each slice on its device."""

from __future__ import annotations

import copy

import pytest
import torch

from support.gpu import ONE_GPU, WITH_ONE_GPU, WITH_ONE_GPU_IDS

bnb = pytest.importorskip("bitsandbytes")

import tensorshard as tp  # noqa: E402
from support.helpers import rel_err  # noqa: E402
from support.quantized_models import ALIGNED, load, quant_config, random_ids, save_llama  # noqa: E402

pytestmark = ONE_GPU + [pytest.mark.timeout(300)]

# The dequantized weights are the unsplit model's, bit for bit; what differs is fp32 rounding between
# bitsandbytes' CUDA kernels and its CPU ones on the CPU slots (the CPU tests: 1e-4 between CPU slots).
FOUR_BIT_TOL = 1e-3


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama"), **ALIGNED)


def on_gpu(model):
    return copy.deepcopy(model).to("cuda:0")


@pytest.mark.parametrize("devices", WITH_ONE_GPU, ids=WITH_ONE_GPU_IDS)
@pytest.mark.parametrize("quant_type,double", [("nf4", True), ("fp4", False)])
def test_4bit_logits_and_greedy_tokens_equal_unsplit_on_the_gpu(llama_dir, gen, quant_type, double, devices):
    quantized = load(llama_dir, 4, quant_type, double)
    ref = on_gpu(quantized)
    model = tp.tensor_parallel(quantized, devices)
    gpu_shard = model.module_shards[devices.index("cuda:0")]
    q = gpu_shard.model.layers[0].self_attn.q_proj.weight
    assert isinstance(q, bnb.nn.Params4bit) and q.device.type == "cuda" and q.quant_state.absmax.device.type == "cuda"
    ids = random_ids(gen)
    with torch.no_grad():
        assert rel_err(model(ids.to(model.device)).logits, ref(ids.to("cuda:0")).logits) < FOUR_BIT_TOL
    generate = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(
        model.generate(ids[:1].to(model.device), **generate).cpu(), ref.generate(ids[:1].to("cuda:0"), **generate).cpu()
    )


@pytest.mark.parametrize("devices", WITH_ONE_GPU, ids=WITH_ONE_GPU_IDS)
def test_8bit_stays_within_its_own_quantization_error(llama_dir, gen, devices):
    """LLM.int8() on the GPU: a row-parallel device quantizes its activations over its own features, so the
    split model is within 8-bit's own error of the full-precision model (as on the CPU), not bit-equal."""
    ids = random_ids(gen)
    with torch.no_grad():
        full = load(llama_dir, None)(ids).logits
        unsplit = on_gpu(load(llama_dir, 8))(ids.to("cuda:0")).logits
        model = tp.tensor_parallel(load(llama_dir, 8), devices)
        split = model(ids.to(model.device)).logits
    own_error = rel_err(unsplit, full)
    assert 1e-4 < own_error < 0.05  # really quantized, and sensibly so
    assert rel_err(split, full) < 1.5 * own_error
    down = model.module_shards[devices.index("cuda:0")].model.layers[0].mlp.down_proj.weight
    assert isinstance(down, bnb.nn.Int8Params) and down.dtype == torch.int8 and down.device.type == "cuda"


@pytest.mark.parametrize("devices", WITH_ONE_GPU, ids=WITH_ONE_GPU_IDS)
def test_qlora_trains_like_the_unsplit_qlora_on_the_gpu(llama_dir, gen, devices):
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def qlora():
        torch.manual_seed(1)  # init_lora_weights=False: B is random too, so the adapter matters from the first step
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        return peft.get_peft_model(load(llama_dir, 4, "nf4", True).train(), config)

    ref = qlora().to("cuda:0")
    model = tp.tensor_parallel(qlora(), devices)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, ref)]
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 9), generator=gen)
        losses = []
        for m, opt in zip((model, ref), optimizers):
            opt.zero_grad()
            x = ids.to(m.device)
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=FOUR_BIT_TOL)


@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cpu", "cpu"]], ids=["gpu", "gpu+2cpu"])
def test_from_pretrained_quantizes_each_slice_on_its_device(llama_dir, gen, devices):
    """quantization_config: the GPU's slices are quantized on the GPU as they are read; with blocks whole, the
    slices are the slices of transformers' own 4-bit load."""
    model = tp.from_pretrained(llama_dir, devices, quantization_config=quant_config(4, "nf4"), progress=False)
    gate = model.module_shards[0].model.layers[1].mlp.gate_proj
    assert isinstance(gate.weight, bnb.nn.Params4bit) and gate.weight.device.type == "cuda"
    assert tuple(gate.weight.quant_state.shape) == (384 // len(devices), 192)
    ref = on_gpu(load(llama_dir, 4, "nf4"))
    ids = random_ids(gen)
    with torch.no_grad():
        assert rel_err(model(ids.to(model.device)).logits, ref(ids.to("cuda:0")).logits) < FOUR_BIT_TOL
