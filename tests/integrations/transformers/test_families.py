"""Families beyond causal LMs, split without a plan: a speech encoder-decoder (Whisper), vision-language
models (LLaVA, Gemma3, Qwen2-VL: a vision tower, a projector, a language model), a seq2seq LM that builds no decoder
inputs itself (Pegasus), a masked LM and a ConvNet classifier (transformers' MobileNetV2). Each: output
parity (fp32, 1e-5 relative), generate token-identical where the model generates, a real split (the largest
device holds less than the whole model), and each device's cache its own heads."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import transformers as T

import tensorshard as tp
from support.helpers import rel_err, split_copy
from tensorshard.integrations.transformers import rank_caches

pytestmark = pytest.mark.timeout(120)


def _load_sweep():
    """benchmarks/coverage.py (the sweep's tiny configs and image-text inputs), loaded by path under another
    name: on sys.path it would shadow the coverage package."""
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "coverage.py"
    spec = importlib.util.spec_from_file_location("coverage_sweep", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["coverage_sweep"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


coverage = _load_sweep()


def _whole_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _split_is_real(model, ref) -> None:
    assert max(sum(p.numel() * p.element_size() for p in s.parameters()) for s in model.module_shards) < _whole_bytes(ref)


def _whisper():
    config = T.WhisperConfig(vocab_size=96, d_model=48, encoder_layers=2, decoder_layers=2, encoder_attention_heads=6,
                             decoder_attention_heads=6, encoder_ffn_dim=88, decoder_ffn_dim=88, num_mel_bins=8,
                             max_source_positions=10, max_target_positions=32, decoder_start_token_id=3,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2, suppress_tokens=None,
                             begin_suppress_tokens=None)
    torch.manual_seed(0)
    return T.WhisperForConditionalGeneration(config).eval()


@pytest.mark.parametrize("n", [2, 3])
def test_whisper_splits_encoder_decoder_and_generates_identically(n, gen):
    ref = _whisper()
    model = split_copy(ref, n)
    styles = {k: type(v).__name__ for k, v in model.plan.items()}
    for side in ("encoder", "decoder"):
        assert styles[f"model.{side}.layers.*.self_attn"] == "Heads"
        assert styles[f"model.{side}.layers.*.fc1"] == "ColwiseParallel"
    assert styles["model.decoder.layers.*.encoder_attn"] == "Heads"
    _split_is_real(model, ref)
    features = torch.randn(2, 8, 20, generator=gen)
    decoder_ids = torch.randint(4, 96, (2, 5), generator=gen)
    with torch.no_grad():
        assert rel_err(model(input_features=features, decoder_input_ids=decoder_ids).logits,
                       ref(input_features=features, decoder_input_ids=decoder_ids).logits) < 1e-5
        options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        expected = ref.generate(features, **options).sequences
        out = model.generate(features, **options)
    assert torch.equal(out.sequences, expected)
    # Whisper's generate rebuilds the cache it returns from per-sample slices; a forward returns the split one
    with torch.no_grad():
        cache = model(input_features=features, decoder_input_ids=decoder_ids, use_cache=True).past_key_values
    caches = rank_caches(cache)
    assert [c.self_attention_cache.layers[0].keys.shape[1] for c in caches] == [6 // n] * n  # own decoder heads
    assert [c.cross_attention_cache.layers[0].keys.shape[1] for c in caches] == [6 // n] * n


# Gemma3's projector is a bare weight matrix (no Linear): nothing to split there
PARTS = {"llava": ("model.vision_tower", "model.multi_modal_projector", "model.language_model"),
         "gemma3": ("model.vision_tower", "model.language_model"),
         "qwen2_vl": ("model.visual", "model.language_model")}  # flattened patches with their grid


@pytest.mark.parametrize("arch", sorted(PARTS))
@pytest.mark.parametrize("n", [2, 3])
def test_vision_language_model_splits_every_part_and_generates_with_an_image(arch, n):
    ref, config, inputs = coverage.build(arch, "image-text-to-text")
    assert "pixel_values" in inputs  # the prompt holds an image, so the vision tower runs
    model = split_copy(ref, n)
    styles = {k: type(v).__name__ for k, v in model.plan.items()}
    for part in PARTS[arch]:
        assert any(k.startswith(part) and s == "ColwiseParallel" for k, s in styles.items()), part
    _split_is_real(model, ref)
    with torch.no_grad():
        assert rel_err(model(**inputs).logits, ref(**inputs).logits) < 1e-5
        first = coverage.first_sample(inputs)
        options = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, return_dict_in_generate=True)
        expected = ref.generate(**first, **options).sequences
        out = model.generate(**first, **options)
    assert torch.equal(out.sequences, expected)
    kv = config.text_config.num_key_value_heads
    heads = [c.layers[0].keys.shape[1] for c in rank_caches(out.past_key_values)]
    assert sum(heads) >= kv and max(heads) < kv or kv < n  # each device caches its own KV heads


def test_pegasus_splits_and_generates(gen):
    ref, _, inputs = coverage.build("pegasus", "seq2seq-lm")
    model = split_copy(ref, 2)
    _split_is_real(model, ref)
    with torch.no_grad():
        assert rel_err(model(**inputs).logits, ref(**inputs).logits) < 1e-5
        ids = inputs["input_ids"][:1]
        assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False),
                           ref.generate(ids, max_new_tokens=5, do_sample=False))


@pytest.mark.parametrize("arch,family", [("electra", "masked-lm"), ("deberta-v2", "sequence-classification"),
                                         ("mobilenet_v2", "image-classification")])
def test_encoders_and_convnets_split(arch, family):
    ref, _, inputs = coverage.build(arch, family)
    model = split_copy(ref, 3)
    _split_is_real(model, ref)
    with torch.no_grad():
        assert rel_err(model(**inputs).logits, ref(**inputs).logits) < 1e-5


def test_writing_through_a_submodule_view_reaches_every_device():
    """Reading `split.model.<attr>` reads the first device's copy; a write goes to every device's copy
    (generation code resets per-call state this way), never only to the view."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import tensorshard as tp

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    split = tp.tensor_parallel(LlamaForCausalLM(config).eval(), ["cpu", "cpu"])
    split.model.some_state = torch.ones(3)
    assert all(torch.equal(shard.model.some_state, torch.ones(3)) for shard in split.module_shards)
    split.model.some_state = None
    assert all(shard.model.some_state is None for shard in split.module_shards)
    assert split.model.some_state is None


@pytest.mark.parametrize("n", [2, 3])
def test_blip2_generates_with_its_query_tokens(n):
    """BLIP-2's generate runs the model's own get_image_features on the split model, which reads the
    top-level parameter query_tokens: the first device's copy, under no_grad; with gradients, a clear error."""
    ref, _, inputs = coverage.build("blip-2", "image-text-to-text")
    model = split_copy(ref, n)
    _split_is_real(model, ref)
    first = coverage.first_sample(inputs)
    with torch.no_grad():
        assert rel_err(model(**inputs).logits, ref(**inputs).logits) < 1e-5
        options = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
        assert torch.equal(model.generate(**first, **options), ref.generate(**first, **options))
    with pytest.raises(AttributeError, match="query_tokens is a parameter of every device's copy"):
        model.query_tokens
