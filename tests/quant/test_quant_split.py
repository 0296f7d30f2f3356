"""Splitting bitsandbytes 4-bit and 8-bit models without dequantizing: parity, local state, memory."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch

import tensorshard as tp
from support.helpers import rel_err
from support.quantized_models import float_kernel, load, quantized_layer_bytes, random_ids

pytestmark = pytest.mark.timeout(120)

FOUR_BIT = [("nf4", True), ("nf4", False), ("fp4", True), ("fp4", False)]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("quant_type,double", FOUR_BIT)
def test_4bit_logits_equal_unsplit(llama_dir, gen, quant_type, double, n):
    """Column (q/k/v, gate/up, lm_head) and row (o_proj, down_proj) splits, 6 heads in 3 KV groups: the
    logits of the unsplit 4-bit model to float32 rounding (1e-4 relative), greedy tokens identical."""
    ref = load(llama_dir, 4, quant_type, double)
    model = tp.tensor_parallel(load(llama_dir, 4, quant_type, double), ["cpu"] * n)
    ids = random_ids(gen)
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref(ids).logits) < 1e-4
    assert torch.equal(
        model.generate(ids[:1], max_new_tokens=6, do_sample=False),
        ref.generate(ids[:1], max_new_tokens=6, do_sample=False),
    )


@pytest.mark.parametrize("quant_type,double", [("nf4", True), ("fp4", False)])
def test_4bit_replicated_kv_heads(few_kv_dir, gen, quant_type, double):
    """2 KV heads over 4 devices: each KV head's 4-bit rows (and absmax) are held by the 2 devices whose query
    heads read it; logits equal the unsplit 4-bit model's."""
    ref = load(few_kv_dir, 4, quant_type, double)
    model = tp.tensor_parallel(load(few_kv_dir, 4, quant_type, double), ["cpu"] * 4)
    ids = random_ids(gen)
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref(ids).logits) < 1e-4
    k_rows = [shard.model.layers[0].self_attn.k_proj.weight for shard in model.module_shards]
    assert [tuple(w.quant_state.shape) for w in k_rows] == [(64, 256)] * 4
    assert torch.equal(k_rows[0].data, k_rows[1].data) and not torch.equal(k_rows[1].data, k_rows[2].data)


@pytest.mark.parametrize("case", ["even-2", "uneven-3", "kv-heads-repeated-4"])
def test_4bit_num_parameters_is_the_unsplit_models(llama_dir, few_kv_dir, case):
    """transformers counts a 4-bit weight as 2 * element_size() values per stored byte; the split model counts
    each device's packed slice the same way, a repeated KV head's rows once and a replicated norm once."""
    path, n = {"even-2": (llama_dir, 2), "uneven-3": (llama_dir, 3), "kv-heads-repeated-4": (few_kv_dir, 4)}[case]
    ref = load(path, 4, "nf4", True)
    model = tp.tensor_parallel(load(path, 4, "nf4", True), ["cpu"] * n)
    for options in ({}, {"exclude_embeddings": True}):
        assert model.num_parameters(**options) == ref.num_parameters(**options)


def test_4bit_devices_hold_quantized_slices(llama_dir):
    """Each device holds a packed 4-bit slice with a quantization state of the slice's shape: never dequantized."""
    model = tp.tensor_parallel(load(llama_dir, 4, "nf4", True), ["cpu"] * 3)
    for rank, shard in enumerate(model.module_shards):
        attn, mlp = shard.model.layers[0].self_attn, shard.model.layers[0].mlp
        for layer, shape in ((attn.q_proj, (64, 192)), (attn.k_proj, (32, 192)), (attn.o_proj, (192, 64)),
                             (mlp.gate_proj, (128, 192)), (mlp.down_proj, (192, 128))):
            w = layer.weight
            assert isinstance(w, bnb.nn.Params4bit) and w.dtype == torch.uint8, (rank, layer)
            assert tuple(w.quant_state.shape) == shape
            assert w.numel() == shape[0] * shape[1] // 2  # two 4-bit codes per byte
            assert w.quant_state.absmax.numel() == shape[0] * shape[1] // 64
            assert layer.quant_state is w.quant_state


@pytest.mark.parametrize("double", [False, True])
def test_4bit_memory_per_device(llama_dir, double):
    """memory_per_device counts packed weights and their quantization state; at 3 devices (every split
    even here) each holds a third of the quantized layers' bytes. Without double quantization the slices
    are exactly a third; with it, slices that start inside a 256-block of the nested absmax store their
    absmax as float32 (exact, docs/quantization.md): a few percent more."""
    ref = load(llama_dir, 4, "nf4", double)
    full = quantized_layer_bytes(ref)
    whole = tp.memory_per_device(ref)["cpu"]
    other = whole - full  # embeddings, norms, lm_head: not quantized
    model = tp.tensor_parallel(ref, ["cpu"] * 3)
    reported = model.memory_per_device()
    per_layer_bound = 1.005 if not double else 1.10
    for rank, shard in enumerate(model.module_shards):
        quantized = quantized_layer_bytes(shard)
        assert quantized <= full / 3 * per_layer_bound, (rank, quantized, full)
        assert quantized >= full / 3 * 0.99
        # everything the device holds: its quantized slices, plus a third of the split embedding and head
        # (the norms and rotary buffers, a few KiB, stay whole)
        assert reported[f"cpu[{rank}]"] == pytest.approx(quantized + other / 3, rel=0.02)


@pytest.mark.parametrize("n", [2, 3])
def test_8bit_within_quantization_error(llama_dir, gen, n):
    """LLM.int8(): column splits are exact; a row-parallel device quantizes its activations over its own
    features, so the split model is not the unsplit 8-bit one, but stays within 8-bit's own error of the
    full-precision model (measured: docs/quantization.md)."""
    ids = random_ids(gen)
    with torch.no_grad():
        full = load(llama_dir, None)(ids).logits
        unsplit = load(llama_dir, 8)(ids).logits
        model = tp.tensor_parallel(load(llama_dir, 8), ["cpu"] * n)
        split = model(ids).logits
    own_error = rel_err(unsplit, full)
    assert 1e-4 < own_error < 0.05  # really quantized, and sensibly so
    assert rel_err(split, full) < 1.5 * own_error
    for shard in model.module_shards:
        w = shard.model.layers[0].mlp.down_proj.weight
        assert isinstance(w, bnb.nn.Int8Params) and w.dtype == torch.int8 and w.shape[1] == 384 // n


def test_8bit_memory_per_device(llama_dir):
    ref = load(llama_dir, 8)
    full = quantized_layer_bytes(ref)
    model = tp.tensor_parallel(ref, ["cpu"] * 3)
    for shard in model.module_shards:
        # int8 codes split 1/3; the row scales of row-parallel layers stay whole (a few hundred bytes)
        assert full / 3 <= quantized_layer_bytes(shard) <= full / 3 * 1.02


def _mlp(bits: int) -> torch.nn.Module:
    """A plain PyTorch MLP of bitsandbytes layers, quantized by moving it to its device (bitsandbytes' way)."""
    torch.manual_seed(0)
    if bits == 4:
        layers = [bnb.nn.Linear4bit(128, 256, quant_type="nf4"), bnb.nn.Linear4bit(256, 128, quant_type="nf4")]
    else:
        layers = [bnb.nn.Linear8bitLt(128, 256, has_fp16_weights=False), bnb.nn.Linear8bitLt(256, 128, has_fp16_weights=False)]
    return float_kernel(torch.nn.Sequential(layers[0], torch.nn.GELU(), layers[1]).to("cpu").eval())


@pytest.mark.parametrize("bits", [4, 8])
def test_plain_module_with_inferred_plan(gen, bits):
    """No preset: plan inference traces the quantized model and self-checks the column -> row pair on a copy
    that keeps the quantized weights."""
    ref = _mlp(bits)
    x = torch.randn(4, 128, generator=gen)
    model = tp.tensor_parallel(_mlp(bits), ["cpu"] * 2)
    assert model.plan["0"] == tp.ColwiseParallel() and model.plan["2"] == tp.RowwiseParallel()
    with torch.no_grad():
        # 4-bit: the unsplit numbers; 8-bit: the second layer's activations are quantized per device
        assert rel_err(model(x), ref(x)) < (1e-4 if bits == 4 else 2e-2)


def test_4bit_weights_repacked_by_an_eval_forward_still_split(gen):
    """On AVX512-BF16 CPUs an eval-mode forward repacks 4-bit weights for bitsandbytes' bf16 kernel, rounding
    absmax to bf16. Splitting afterwards unpacks them: the split model computes with that bf16 absmax, so it
    is within bf16 rounding (not 1e-4) of the model before the repacking."""
    ref = _mlp(4)
    x = torch.randn(4, 128, generator=gen)
    model = _mlp(4)
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = bnb.functional.has_avx512bf16()
    with torch.no_grad():
        model(x)
    plan = tp.Plan({"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()})
    split = tp.tensor_parallel(model, ["cpu"] * 2, plan=plan)
    with torch.no_grad():
        assert rel_err(split(x), ref(x)) < 1e-2


def test_4bit_trains_its_full_precision_parameters(llama_dir, gen):
    """Backward runs through the split 4-bit layers (column and row): training the parameters that stay in
    full precision (embedding, norms, lm_head; ZeRO-3 partitions the replicated ones, the default when
    training) gives the unsplit model's losses over 3 AdamW steps (1e-4 relative)."""
    ref = load(llama_dir, 4, "nf4", True).train()
    model = tp.tensor_parallel(load(llama_dir, 4, "nf4", True).train(), ["cpu"] * 3)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (ref, model)]
    for _ in range(3):
        ids = random_ids(gen)
        losses = []
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-4)
