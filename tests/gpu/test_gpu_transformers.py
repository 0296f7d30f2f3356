"""A transformers causal LM (the suite's tiny Llama: 9 query heads in 3 KV groups, as SmolLM2) on the device lists
one GPU reaches: logits, greedy decoding with each device's KV cache on that device, AdamW losses, gradient
checkpointing, LoRA, and half-precision training and decoding.

fp32 against the unsplit model on the CPU: logits within 1e-4 relative, losses within 1e-4 (GPU kernels round
differently from the CPU's; TF32 stays off for matmuls by default), greedy tokens identical. Half precision
against the unsplit model in the same dtype on the GPU (tolerances stated at each test).
"""

import copy
import warnings

import pytest
import torch

import tensorshard as tp
from support.gpu import ONE_GPU, WITH_ONE_GPU, WITH_ONE_GPU_IDS, assert_on_their_devices
from support.hf_configs import VOCAB, tiny_model
from support.helpers import rel_err
from tensorshard.integrations.transformers import rank_caches

pytestmark = ONE_GPU + [pytest.mark.timeout(300)]

TOL = 1e-4


def adamw_losses(model, ref, gen, steps: int = 3, lr: float = 1e-3) -> list[tuple[float, float]]:
    """(split, unsplit) loss of each of `steps` AdamW steps on the same batches; inputs on each model's device."""
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr) for m in (model, ref)]
    losses = []
    for _ in range(steps):
        ids = torch.randint(1, VOCAB, (2, 8), generator=gen)
        pair = []
        for m, opt in zip((model, ref), optimizers):
            opt.zero_grad()
            x = ids.to(m.device)
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            pair.append(loss.item())
        losses.append(tuple(pair))
    return losses


@pytest.mark.parametrize("devices", WITH_ONE_GPU, ids=WITH_ONE_GPU_IDS)
def test_logits_and_greedy_decoding_with_a_kv_cache_per_device(devices, gen):
    ref = tiny_model("llama")
    model = tp.tensor_parallel(copy.deepcopy(ref), devices)
    assert_on_their_devices(model, devices)
    ids = torch.randint(1, VOCAB, (2, 9), generator=gen)
    with torch.no_grad():
        assert rel_err(model(input_ids=ids.to(model.device)).logits, ref(input_ids=ids).logits) < TOL
    generate = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    out = model.generate(ids[:1].to(model.device), **generate, return_dict_in_generate=True)
    assert torch.equal(out.sequences.cpu(), ref.generate(ids[:1], **generate))
    # each device keeps the keys and values of its own KV heads, on that device: 3 KV heads over the slots
    caches = rank_caches(out.past_key_values)
    assert [c.layers[0].keys.device.type for c in caches] == [torch.device(d).type for d in devices]
    assert sum(c.layers[0].keys.shape[1] for c in caches) == 3


@pytest.mark.parametrize("devices", WITH_ONE_GPU, ids=WITH_ONE_GPU_IDS)
def test_adamw_losses_match_the_unsplit_model(devices, gen):
    ref = tiny_model("llama").train()
    model = tp.tensor_parallel(copy.deepcopy(ref), devices)
    for got, want in adamw_losses(model, ref, gen):
        assert got == pytest.approx(want, rel=TOL)


@pytest.mark.parametrize("devices", WITH_ONE_GPU, ids=WITH_ONE_GPU_IDS)
def test_gradient_checkpointing_gives_the_unsplit_losses(devices, gen):
    """transformers' gradient_checkpointing_enable() on the split model: every shard recomputes its layers in
    its own backward pass."""
    ref = tiny_model("llama").train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it activation_checkpointing_enable
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = tp.tensor_parallel(copy.deepcopy(ref), devices)
    for got, want in adamw_losses(model, ref, gen):
        assert got == pytest.approx(want, rel=TOL)


@pytest.mark.parametrize("devices", WITH_ONE_GPU, ids=WITH_ONE_GPU_IDS)
def test_lora_trains_like_the_unsplit_peft_model(devices, gen):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)  # init_lora_weights=False: B is random too, so the adapter matters from the first step
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], init_lora_weights=False)
    ref = peft.get_peft_model(tiny_model("llama"), config)
    model = tp.tensor_parallel(copy.deepcopy(ref), devices)
    ids = torch.randint(1, VOCAB, (2, 8), generator=gen)
    with torch.no_grad():
        assert rel_err(model(input_ids=ids.to(model.device)).logits, ref(input_ids=ids).logits) < TOL
    for got, want in adamw_losses(model, ref, gen, lr=1e-2):
        assert got == pytest.approx(want, rel=TOL)


@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cpu"]], ids=["gpu", "gpu+cpu"])
def test_bf16_weights_train_and_decode_like_the_unsplit_bf16_model(devices, gen):
    """A bf16 model (weights, gradients and AdamW state in bf16) against the unsplit bf16 model on the GPU.
    On the GPU alone the shard runs the unsplit model's kernels: greedy tokens identical. Beside a CPU slot, a
    row-parallel layer adds two bf16 partial sums (and the CPU rounds its bf16 matmuls its own way): losses
    within 2e-2 relative, bf16's 8-bit mantissa over a few layers."""
    ref = tiny_model("llama").to("cuda:0", torch.bfloat16)
    model = tp.tensor_parallel(copy.deepcopy(ref).cpu(), devices)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = torch.randint(1, VOCAB, (1, 6), generator=gen, device="cuda:0")
    generate = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    if devices == ["cuda:0"]:
        assert torch.equal(model.generate(ids, **generate), ref.generate(ids, **generate))
    ref.train(), model.train()
    for got, want in adamw_losses(model, ref, gen):
        assert got == pytest.approx(want, rel=1e-3 if devices == ["cuda:0"] else 2e-2)


@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cpu"]], ids=["gpu", "gpu+cpu"])
def test_fp16_autocast_training_matches_the_unsplit_model(devices, gen):
    """torch.autocast on the caller's thread reaches every shard's thread (engines/inprocess/workers.py): fp32
    weights, fp16 matmuls on the GPU, against the unsplit model under the same autocast. The CPU slot's matmuls
    stay fp32 (autocast("cuda") does not touch them): losses within 1e-2 relative, fp16 rounding."""
    ref = tiny_model("llama").to("cuda:0").train()
    model = tp.tensor_parallel(copy.deepcopy(ref).cpu(), devices)
    with torch.autocast("cuda", dtype=torch.float16):
        losses = adamw_losses(model, ref, gen)
    for got, want in losses:
        assert got == pytest.approx(want, rel=1e-2)
