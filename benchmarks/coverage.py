"""Coverage of automatic plans over every architecture of transformers' auto-model mappings, per family.

    PYTHONPATH=src python benchmarks/coverage.py                        # causal LMs: resume, then write docs/coverage.md
    PYTHONPATH=src python benchmarks/coverage.py --family image-classification
    PYTHONPATH=src python benchmarks/coverage.py --family all           # every family, one after another
    PYTHONPATH=src python benchmarks/coverage.py --only llama gpt2 --redo
    PYTHONPATH=src python benchmarks/coverage.py --table                # rewrite the tables from the stored results

Families (`FAMILIES`): causal LM, masked LM, seq2seq LM, sequence classification, image classification,
speech seq2seq, image-text-to-text. For each model type of the family's mapping: build it from a tiny random
config (its defaults with hidden sizes, layers, heads, experts, vocabulary and image size shrunk), fp32, eval
mode, and run it on the input it describes (`tensorshard.plan_inference.model_inputs`: its main input sized by its
config, decoder ids for an encoder-decoder). A type that does not build or run is counted as *not
buildable*, with the reason. Every other type is split with ``tp.tensor_parallel(model, ["cpu"] * n)`` and no
plan (a preset if one exists, else an inferred, self-checked plan) for n = 2 and 3, and passes when:

- its main output (logits) on a random batch is within 1e-4 of the unsplit model's, relative to the
  largest reference value (at least 1),
- for families that generate: greedy decoding of 6 tokens is identical (``generate()``; image-text-to-text
  models decode from text alone),
- the largest device holds fewer parameter bytes than the whole model.

Results are appended to benchmarks/results/coverage[-family].jsonl one architecture at a time, so an
interrupted sweep resumes where it stopped (it takes tens of minutes per family on two CPU cores; run it
with nohup and nice).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import inspect
import json
import logging
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(os.environ.get("COVERAGE_RESULTS", ROOT / "benchmarks" / "results"))  # another folder: a second sweep
TABLE = ROOT / "docs" / "coverage.md"
WORLDS = (2, 3)
TOL = 1e-4
NEW_TOKENS = 6
TIMEOUT = 300  # seconds per architecture


@dataclass(frozen=True)
class Family:
    title: str
    mapping: str  # the auto-model mapping of transformers.models.auto.modeling_auto
    auto_class: str
    generates: bool

    def results(self, name: str) -> Path:
        return RESULTS_DIR / ("coverage.jsonl" if name == "causal-lm" else f"coverage-{name}.jsonl")


FAMILIES = {
    "causal-lm": Family("Causal LM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM", True),
    "masked-lm": Family("Masked LM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM", False),
    "seq2seq-lm": Family("Seq2seq LM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM", True),
    "sequence-classification": Family("Sequence classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                                      "AutoModelForSequenceClassification", False),
    "image-classification": Family("Image classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
                                   "AutoModelForImageClassification", False),
    "speech-seq2seq": Family("Speech seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq", True),
    "image-text-to-text": Family("Image-text-to-text", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                                 "AutoModelForImageTextToText", True),
}

# Tiny sizes, by config attribute name. Heads 4 with 2 KV heads keeps grouped-query attention in play.
HIDDEN = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim", "embedding_size", "word_embed_proj_dim",
          "attention_hidden_size", "embedding_dim", "pooler_hidden_size", "encoder_hidden_size", "d_latents",
          "cross_attention_hidden_size")
FFN = ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim", "encoder_ffn_dim",
       "inner_hidden_size", "mlp_dim", "ff_dim", "dense_intermediate_size", "hidden_dim", "feed_forward_size")
MOE_FFN = ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
           "moe_ffn_hidden_size", "moe_hidden_size", "shared_intermediate_size", "expert_hidden_size",
           "expert_ffn_hidden_size", "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size")
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
          "num_decoder_layers", "num_encoder_layers", "num_blocks", "depth", "num_self_attends_per_block")
HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads", "encoder_attention_heads")
KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "num_kv")
HEAD_DIM = ("head_dim", "attention_head_dim", "kv_channels", "head_size", "attention_head_size")
POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length")
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k")
SMALL = {"kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
         "n_shared_experts": 1, "num_shared_experts": 1, "first_k_dense_replace": 1, "sliding_window": 64,
         "vocab_size": 512, "n_group": 1, "n_groups": 1, "topk_group": 1, "num_expert_group": 1, "num_codebooks": 2, "rotary_dim": 8,
         "state_size": 16, "time_step_rank": 8, "num_kv_shared_layers": 0, "zero_expert_num": 2,
         "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8, "num_layers_per_stack": 1,
         # state-space and linear-attention mixers of hybrid models
         "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_dt_rank": 8, "n_mamba_heads": 2,
         "mamba_d_ssm": 128, "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16,
         "num_filters": 8, "num_latents": 16,  # audio codecs' first conv width (doubled per downsampling stage) "vocab_size_per_layer_input": 512, "hidden_size_per_layer_input": 16, "lru_width": 64,
         "shape_vocab_size": 512, "pronunciation_vocab_size": 512, "shape_embed_dim": 64, "pronunciation_embed_dim": 64,
         "linear_head_dim": 16, "linear_num_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
         "linear_num_key_heads": 2, "linear_num_value_heads": 4,
         "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1}


def tiny_config(model_type: str, keep_layers: bool = False, images: bool = True, causal: bool = True):
    """The default config of `model_type`, shrunk; `keep_layers` keeps the layer count and per-layer lists
    (some hybrids need layers of every kind in a fixed pattern); `images` shrinks the image size; `causal`
    makes BERT-like encoders decoders (`is_decoder`), as causal LMs (other families keep them bidirectional)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    _shrink(cfg, keep_layers=keep_layers, images=images)
    if causal and "is_decoder" in cfg.to_dict() and not getattr(cfg, "is_encoder_decoder", False):
        cfg.is_decoder = True  # BERT-like models as causal LMs
    return cfg


def _narrow(widths: list[int]) -> list[int]:
    """Per-stage widths of a vision backbone, scaled so the first is about 128 (a bottleneck quarter still fills
    GroupNorm's 32 groups), multiples of 8."""
    factor = max(1, widths[0] // 128)
    return [max(8, v // factor // 8 * 8) for v in widths]


IMAGE = 64  # image side of tiny vision configs
STAGE_LISTS = {"depths": lambda v: [1] * len(v), "hidden_sizes": _narrow, "embed_dims": _narrow,
               "neck_hidden_sizes": _narrow, "num_heads": lambda v: [4] * len(v), "num_attention_heads": lambda v: [4] * len(v)}


def _shrink(cfg, depth: int = 0, keep_layers: bool = False, images: bool = True) -> None:
    from transformers import PretrainedConfig

    values = cfg.to_dict()
    layers0 = next((values[k] for k in LAYERS if isinstance(values.get(k), int)), None)
    heads0 = next((values[k] for k in HEADS if isinstance(values.get(k), int)), None)
    if layers0 is None:  # no layer count, only a per-layer pattern (NemotronH's layers_block_type)
        layers0 = next((len(v) for k, v in values.items() if "layer" in k and isinstance(v, list) and len(v) > 2
                        and all(isinstance(x, str) for x in v)), None)

    def put(key, value):
        try:
            setattr(cfg, key, value)
        except Exception:
            pass

    # Layers to keep: two, or the first layer of each kind when a per-layer list names kinds (hybrids).
    pick = None
    stages = isinstance(values.get("depths"), list) and len(values["depths"]) == layers0  # Swin: layers are stages
    if layers0 and layers0 > 2 and not keep_layers and not stages:
        kinds = next((v for v in values.values() if isinstance(v, list) and len(v) == layers0
                      and all(isinstance(x, str) for x in v)), None)
        pick = sorted({kinds.index(k) for k in kinds}) if kinds else []
        for i in range(layers0):
            if len(pick) >= 2:
                break
            if i not in pick:
                pick.append(i)
        pick = sorted(pick)
    for key, value in values.items():
        if isinstance(getattr(cfg, key, None), PretrainedConfig) and depth < 4:
            _shrink(getattr(cfg, key), depth + 1, keep_layers, images)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, list)):
            continue
        if key in HIDDEN and isinstance(value, int):
            put(key, 64)
        elif key in FFN and isinstance(value, int):
            put(key, 128)
        elif key in MOE_FFN and isinstance(value, int):
            put(key, 64)
        elif key in LAYERS and isinstance(value, int):
            if pick is not None:
                put(key, len(pick))
        elif key in HEADS and isinstance(value, int):
            put(key, 4)
        elif key in KV_HEADS and isinstance(value, int):
            put(key, 1 if value == 1 else 4 if heads0 is not None and value >= heads0 else 2)
        elif key in HEAD_DIM and isinstance(value, int):
            put(key, 16)
        elif key in POSITIONS and isinstance(value, int):
            put(key, 256)
        elif key in EXPERTS and isinstance(value, int) and value > 4:
            put(key, 4)
        elif key in TOP_K and isinstance(value, int):
            put(key, min(value, 2))
        elif key in SMALL and isinstance(value, int):
            put(key, SMALL[key])
        elif isinstance(value, list) and pick is not None and len(value) == layers0:
            put(key, [value[i] for i in pick])  # per-layer lists (layer_types, ...)
        elif key in STAGE_LISTS and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value) and not (
                key == "hidden_sizes" and "stage_out_channels" in values):  # HGNet-V2: its widths live in stage_* lists
            put(key, STAGE_LISTS[key](value))  # per-stage lists of vision backbones
        elif key in ("image_size", "img_size") and images:
            put(key, IMAGE if isinstance(value, int) else [IMAGE] * len(value))
    # Sizes that must agree with others.
    if "qk_rope_head_dim" in values and "head_dim" in values:
        put("head_dim", SMALL["qk_rope_head_dim"])  # multi-head latent attention: rotary part of the head
    if "qk_head_dim" in values:
        put("qk_head_dim", SMALL["qk_rope_head_dim"] + SMALL["qk_nope_head_dim"])
    if "axial_pos_embds_dim" in values:  # Reformer: the axial position parts add up to the hidden size, and
        put("axial_pos_embds_dim", (32, 32))  # their shape to the longest sequence
        put("axial_pos_shape", (16, 16))
    if "expand" in values and "num_heads" in values and "head_dim" in values:  # Mamba-2: heads x head_dim = expand x hidden
        put("num_heads", values["expand"] * 64 // 16)
    if "width_coefficient" in values and "hidden_dim" in values:  # EfficientNet: B0's widths (hidden_dim is its top conv)
        put("width_coefficient", 1.0)
        put("depth_coefficient", 1.0)
        put("hidden_dim", 1280)
    if any(values.get(k) for k in EXPERTS) and any(k in values and values[k] is None for k in TOP_K):
        put(next(k for k in TOP_K if k in values), 2)  # DeepSeek-V2's default leaves the top-k unset
    kinds = getattr(cfg, "layer_types", None)
    if isinstance(kinds, list) and len(kinds) > 1 and set(kinds) == {"linear_attention"}:
        put("layer_types", kinds[:-1] + ["full_attention"])  # a default without attention layers cannot cache
    if "attn_layer_indices" in values and values["attn_layer_indices"] is None and "mamba_n_heads" in values:
        put("attn_layer_indices", [1])  # Bamba's default has no attention layer, which its cache cannot handle
    if values.get("is_encoder_decoder") and getattr(cfg, "decoder_start_token_id", None) is None:
        pad = getattr(cfg, "pad_token_id", None)
        put("decoder_start_token_id", pad if isinstance(pad, int) else 0)  # T5's default leaves it to the tokenizer
    if "mm_tokens_per_image" in values:  # Gemma3: image tokens pooled from the tiny image's patches
        put("mm_tokens_per_image", 4)
    rope = getattr(cfg, "rope_parameters", None)
    multimodal_rope = "mrope_section" in getattr(type(cfg), "ignore_keys_at_rope_validation", ()) or (
        isinstance(rope, dict) and "mrope_section" in rope) or _names_mrope_in_init(type(cfg))
    if isinstance(rope, dict) and multimodal_rope:
        half = (getattr(cfg, "head_dim", None) or 16) // 2  # Qwen2-VL: the rotary sections must cover half a head
        put("rope_parameters", dict(rope, mrope_section=[half - 2 * (half // 3), half // 3, half // 3]))
    text = getattr(cfg, "text_config", None)
    vocab = getattr(cfg, "vocab_size", None) or getattr(text, "vocab_size", None)
    if isinstance(vocab, int):
        for key, value in cfg.to_dict().items():
            if (key.endswith("_token_id") or key.endswith("_token_index")) and isinstance(value, int) and value >= vocab:
                put(key, 1)


def _names_mrope_in_init(config_class: type) -> bool:
    """transformers 5.0 names Qwen2-VL's rotary sections only inside the config's __init__
    (``ignore_keys_at_rope_validation={"mrope_section"}``); later releases as a class attribute (above)."""
    try:
        return '"mrope_section"' in inspect.getsource(config_class.__init__)
    except (OSError, TypeError):
        return False


def build(model_type: str, family: str = "causal-lm"):
    """A tiny random model of this type and the inputs it runs on: fully shrunk, else with its layer pattern
    kept (hybrids), else with its default image size."""
    import transformers
    from transformers import AutoConfig

    auto = getattr(transformers, FAMILIES[family].auto_class)
    errors = []
    for keep_layers, images in ((False, True), (True, True), (False, False)):
        try:
            cfg = tiny_config(model_type, keep_layers, images, causal=family == "causal-lm")
            if family == "sequence-classification":
                _give_pad_token(cfg)
            torch.manual_seed(0)
            model = auto.from_config(cfg).float().eval()
            if hasattr(model, "set_default_language"):  # X-MOD: adapters per language
                model.set_default_language(next(iter(getattr(cfg, "languages", ["en_XX"]))))
            if family != "causal-lm":
                _randomize_zeros(model)
            return model, cfg, inputs_for(model, cfg, family)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {_first(e)}")
    try:  # is it our shrinking, or does the default config not build either?
        with torch.device("meta"):
            auto.from_config(AutoConfig.for_model(model_type))
    except Exception as e:
        raise RuntimeError(f"its default config does not build either ({type(e).__name__}: {_first(e)})") from e
    raise RuntimeError(errors[0])


def _give_pad_token(cfg) -> None:
    """Decoder-only classifiers pool at the last non-pad token and refuse a batch without a pad token
    (checkpoints set one; default configs often do not): the eos token, else 0, as fine-tuning scripts do."""
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is not None and hasattr(c, "pad_token_id") and getattr(c, "pad_token_id", None) is None:
            eos = getattr(c, "eos_token_id", None)
            eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
            try:
                c.pad_token_id = eos if isinstance(eos, int) else 0
            except Exception:
                pass


def _randomize_zeros(model) -> None:
    """Parameters initialised to zero (classifier heads, biases, layer scales) get small random values: a
    zero head makes every logit 0, and the parity of zeros proves nothing."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.numel() and not bool(p.any()):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))


def inputs_for(model, cfg, family: str) -> dict:
    """The batch parity is measured on: 8 random ids for causal LMs (4 and up: clear of special tokens),
    else the first input the model describes itself (model_inputs.py) that it runs on."""
    from tensorshard.plan_inference.model_inputs import model_input_candidates

    gen = torch.Generator().manual_seed(1)
    if family == "image-text-to-text":
        try:
            return image_text_inputs(model, cfg, gen)
        except Exception:
            pass  # decoded from text alone (the table's inputs column says so)
    if family == "causal-lm":
        vocab = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", 512)
        candidates = [{"input_ids": torch.randint(4, max(5, min(int(vocab), 512)), (2, 8), generator=gen)}]
    else:
        candidates = list(model_input_candidates(model, gen))
        if not candidates:
            raise RuntimeError(f"{type(model).__name__} describes no input (main_input_name {model.main_input_name!r})")
    errors = []
    for inputs in candidates:
        inputs = {k: v for k, v in inputs.items() if k != "use_cache"}
        try:
            with torch.no_grad():
                model(**inputs)
            return inputs
        except Exception as e:
            errors.append(f"forward on {', '.join(inputs)}: {type(e).__name__}: {_first(e)}")
    raise RuntimeError(errors[0])


def image_text_inputs(model, cfg, gen: torch.Generator) -> dict:
    """Text with one image per sample: pixel_values at the vision config's size, and as many image tokens
    as the model's own `get_image_features` makes of them, between a few text ids."""
    import inspect

    from tensorshard.plan_inference.model_inputs import vocab_size

    from tensorshard.plan_inference.model_inputs import patch_grid_inputs

    token = next((v for v in (getattr(cfg, "image_token_id", None), getattr(cfg, "image_token_index", None))
                  if isinstance(v, int)), None)
    vision = cfg.vision_config
    if token is None and hasattr(cfg, "num_query_tokens"):  # BLIP-2 style: the default config names no image token
        token = vocab_size(model) - 1
        for key in ("image_token_id", "image_token_index"):
            if hasattr(cfg, key):
                setattr(cfg, key, token)
    if token is None:
        raise ValueError(f"{type(cfg).__name__} names no image token")
    takes = inspect.signature(model.get_image_features).parameters
    extra = {}
    if "image_grid_thw" in takes:  # Qwen2-VL style: flattened patches and their grid
        grid = patch_grid_inputs(vision, gen, images=2, key="pixel_values", grid_key="image_grid_thw")
        pixels, extra["image_grid_thw"] = grid["pixel_values"], grid["image_grid_thw"]
    else:
        size = vision.image_size if isinstance(vision.image_size, int) else vision.image_size[-1]
        pixels = torch.randn(2, getattr(vision, "num_channels", 3), size, size, generator=gen)
        if "image_sizes" in takes:
            extra["image_sizes"] = torch.tensor([[size, size]] * 2)
    if "qformer_input_ids" in takes:  # InstructBLIP: its Q-Former reads text ids of its own
        qvocab = getattr(getattr(cfg, "qformer_config", None), "vocab_size", 512)
        extra["qformer_input_ids"] = torch.randint(4, max(5, min(qvocab, 512)), (2, 4), generator=gen)
    first = pixels[: len(pixels) // 2]  # one image's patches (flattened patches: half the rows)
    with torch.no_grad():
        features = model.get_image_features(pixel_values=first, **{k: v[:1] for k, v in extra.items()})
    features = getattr(features, "pooler_output", features)
    if isinstance(features, (list, tuple)):
        count = sum(f.reshape(-1, f.shape[-1]).shape[0] for f in features)
    else:
        count = features.reshape(-1, features.shape[-1]).shape[0]
    vocab = vocab_size(model)
    text = torch.randint(4, max(5, min(vocab, 512)), (2, 6), generator=gen)
    text[text == token] = 4
    image = torch.full((2, count), token)
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # Qwen2-VL's multimodal positions
        ids = torch.cat([text[:, :3], image, text[:, 3:]], 1)
        extra["mm_token_type_ids"] = (ids == token).long()
    elif isinstance(getattr(model.config, "vision_start_token_id", None), int) and token < 3:
        # transformers 5.0's Qwen2-VL finds an image's positions by the vision-start token before it (the shrunk
        # config names every special token 1): a start and a video token of their own, below the text's ids
        model.config.vision_start_token_id, model.config.video_token_id = token + 1, token + 2
        image = torch.cat([torch.full((2, 1), token + 1), image], 1)
    ids = torch.cat([text[:, :3], image, text[:, 3:]], 1)
    inputs = {"input_ids": ids, "pixel_values": pixels, **extra}
    with torch.no_grad():
        model(**inputs)
    return inputs


def first_sample(inputs: dict) -> dict:
    """The first sample of a batch, without decoder inputs (generate makes them); flattened image patches
    (Qwen2-VL) are cut at the first image's grid."""
    first = {k: v[:1] for k, v in inputs.items() if not k.startswith("decoder_")}
    if "image_grid_thw" in inputs:
        first["pixel_values"] = inputs["pixel_values"][: int(inputs["image_grid_thw"][0].prod())]
    return first


def main_output(model, inputs: dict) -> torch.Tensor:
    out = model(**inputs)
    for key in ("logits", "last_hidden_state"):
        value = out.get(key) if isinstance(out, dict) else None
        if isinstance(value, torch.Tensor):
            return value.float()
    return (out[0] if isinstance(out, (tuple, list)) else out).float()


def greedy(model, inputs: dict, use_generate: bool) -> list[int]:
    """Greedy continuation of the first sample: `generate()` (KV cache) when asked, else full forwards
    without a cache (decoder-only models)."""
    first = first_sample(inputs)
    if use_generate:
        out = model.generate(**first, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        prompt = first.get("input_ids")
        start = prompt.shape[1] if prompt is not None and not getattr(model.config, "is_encoder_decoder", False) else 0
        return out[0, start:].tolist()
    seq = first["input_ids"]
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            nxt = main_output(model, {"input_ids": seq})[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    return seq[0, first["input_ids"].shape[1]:].tolist()


def run_one(model_type: str, family: str = "causal-lm") -> dict:
    import tensorshard as tp
    from tensorshard.plan_inference.infer import infer
    from tensorshard.plans.presets import PRESETS, preset_for

    rec: dict = {"arch": model_type, "commit": _git("rev-parse", "--short", "HEAD"),  # the code it ran on
                 "date": datetime.date.today().isoformat()}
    t0 = time.time()
    try:
        model, cfg, inputs = build(model_type, family)
    except Exception as e:
        return rec | {"buildable": False, "reason": _first(e)}
    rec["class"] = type(model).__name__
    generates = FAMILIES[family].generates and "input_ids" in inputs or FAMILIES[family].generates and model.can_generate()
    try:
        with torch.no_grad():
            ref = main_output(model, inputs)
            ref_tokens = {}
            if generates:
                use_generate = model.can_generate()
                ref_tokens[use_generate] = greedy(model, inputs, use_generate)
    except Exception as e:
        return rec | {"buildable": False, "reason": f"unsplit run: {type(e).__name__}: {_first(e)}"}
    whole = _param_bytes(model)  # parameters only (buffers such as rotary tables stay whole everywhere)
    rec.update(buildable=True, params=sum(p.numel() for p in model.parameters()), whole_bytes=whole,
               inputs=sorted(inputs))
    scale = max(1.0, ref.abs().max().item())
    for n in WORLDS:
        r: dict = {}
        try:
            work = copy.deepcopy(model)
            preset = preset_for(work)
            if preset is not None:
                split = tp.tensor_parallel(work, ["cpu"] * n)
                if model_type in PRESETS:
                    r["plan"] = "preset"
                else:  # translated from base_model_tp_plan: used if it passes the self-check, else inferred
                    r["plan"] = "translated" if split.plan == preset else "inferred (translated plan did not fit)"
            else:
                report = infer(work, n, check=True)
                r["fallbacks"] = _distinct_fallbacks(report.fallbacks)
                r["groups"] = {k: sum(1 for g in report.groups if g.outcome != "whole" and g.describe() == k)
                               for k in {g.describe() for g in report.groups if g.outcome != "whole"}}
                r["embeddings"] = len(report.embeddings)
                r["parts"] = {name: _describe(part) for name, part in report.parts.items()}
                split = tp.tensor_parallel(work, ["cpu"] * n, plan=report.plan)
                r["plan"] = "inferred"
            with torch.no_grad():
                out = main_output(split, inputs)
                r["max_diff"] = (out - ref).abs().max().item()
                r["logits_ok"] = bool(r["max_diff"] <= TOL * scale)
                if generates:
                    use_generate = hasattr(split, "generate") and model.can_generate()
                    if use_generate not in ref_tokens:
                        ref_tokens[use_generate] = greedy(model, inputs, use_generate)
                    r["greedy_ok"] = greedy(split, inputs, use_generate) == ref_tokens[use_generate]
                    r["generate"] = use_generate
            per_device = max(_param_bytes(shard) for shard in split.module_shards)
            r["mem_ratio"] = per_device / whole
            r["mem_ok"] = per_device < whole
            r["ok"] = r["logits_ok"] and r.get("greedy_ok", True) and r["mem_ok"]
        except Exception as e:
            r.update(ok=False, error=f"{type(e).__name__}: {_first(e)}", trace=traceback.format_exc(limit=-3))
        rec[str(n)] = r
    rec["seconds"] = round(time.time() - t0, 1)
    return rec


def _describe(report) -> str:
    """What an inferred plan splits, in a few words (the groups of a part inferred on its own)."""
    kinds: dict[str, int] = {}
    for g in report.groups:
        if g.outcome != "whole":
            kinds[g.describe()] = kinds.get(g.describe(), 0) + 1
    return ", ".join(f"{v} x {k}" for k, v in sorted(kinds.items())) or "nothing"


def _param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _distinct_fallbacks(fallbacks) -> list[str]:
    """One line per kind of fallback: layer numbers generalised (layers.*.mlp), with a count."""
    import re

    seen: dict[str, int] = {}
    for f in fallbacks:
        line = re.sub(r"\.\d+\.", ".*.", f.line())
        seen[line] = seen.get(line, 0) + 1
    return [f"{line} (x{n})" if n > 1 else line for line, n in seen.items()]


def _first(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


CAUSAL_MEASURED = "2026-11-24 (commit 3763379; from gemma4 on, and for dory, with the output-head preset change of f77c7ec; reformer rerun with the per-device copies of its own cache class)"
OTHERS_MEASURED = "in one session on 2026-11-24, after that day's fixes (issue 15)"
MEMORY_LIMIT = 6 << 30  # bytes of address space per architecture: a runaway model fails alone


def sweep(types: list[str], redo: bool, family: str = "causal-lm") -> None:
    """Each architecture in its own process, under a time and memory limit; results appended as it goes."""
    results = FAMILIES[family].results(family)
    results.parent.mkdir(parents=True, exist_ok=True)
    # A redo appends: the latest record of an architecture counts (load), so an interrupted redo keeps the
    # earlier records of what it did not reach; the file is compacted at the end.
    done = {r["arch"] for r in load(family)} - (set(types) if redo else set())
    for i, t in enumerate(types):
        if t in done:
            continue
        rec = _isolated(t, family)
        with results.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        status = "not buildable" if not rec.get("buildable") else " ".join(
            f"{n}:{'ok' if rec.get(str(n), {}).get('ok') else 'FAIL'}" for n in WORLDS)
        print(f"[{family} {i + 1}/{len(types)}] {t}: {status} ({rec.get('seconds', '?')} s)", flush=True)
    _rewrite(results, load(family))


def _isolated(model_type: str, family: str) -> dict:
    def limit():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    failed = {"ok": False}
    stamp = {"commit": _git("rev-parse", "--short", "HEAD"), "date": datetime.date.today().isoformat()}
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", model_type, "--family", family], capture_output=True, text=True,
            timeout=TIMEOUT, preexec_fn=limit, cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        why = f"timed out after {TIMEOUT} s"
        return {"arch": model_type, "buildable": True, "2": failed | {"error": why}, "3": failed | {"error": why}} | stamp
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        why = f"crashed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}"[:300]
        return {"arch": model_type, "buildable": True, "2": failed | {"error": why}, "3": failed | {"error": why}} | stamp
    return json.loads(lines[-1])


def load(family: str = "causal-lm") -> list[dict]:
    results = FAMILIES[family].results(family)
    if not results.exists():
        return []
    latest = {}
    for line in results.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            latest[rec["arch"]] = rec
    return list(latest.values())


def _rewrite(results: Path, records: list[dict]) -> None:
    tmp = results.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(results)


def write_table() -> None:
    """docs/coverage.md: a summary per family, then each family's table (families without results are left
    out)."""
    import transformers

    import tensorshard

    commit = _git("rev-parse", "--short", "HEAD")
    measured = [(name, sorted(load(name), key=lambda r: r["arch"])) for name in FAMILIES]
    measured = [(name, records) for name, records in measured if records]
    lines = [
        "# Coverage of automatic plans",
        "",
        f"Written {datetime.date.today().isoformat()} by `benchmarks/coverage.py` on {platform.machine()} CPU "
        f"({platform.system()}), torch {torch.__version__}, transformers {transformers.__version__}, "
        f"tensorshard {tensorshard.__version__} (commit {commit}).",
        "",
        "Every architecture of transformers' auto-model mappings, one family per mapping, built from a tiny "
        "random config (2 layers, hidden 64, 4 heads with 2 KV heads where the architecture has them, "
        f"vocabulary 512, {IMAGE} x {IMAGE} images, one block per stage of a vision backbone, fp32), run on the "
        "input it describes itself (its main input sized by its config, decoder ids for an encoder-decoder) and "
        "split with `tp.tensor_parallel(model, [\"cpu\"] * n)` without a plan. A pass at n devices: the main "
        f"output (logits) within {TOL:g} of the unsplit model's (relative to the largest value, at least 1), "
        f"greedy decoding of {NEW_TOKENS} tokens identical where the family generates, and less parameter memory "
        "on the largest device than the whole model. Image-text-to-text models get one image per prompt when "
        "their own `get_image_features` says how many image tokens it makes (else text only, as the table notes). "
        "Parameters a tiny config initialises to zero (classifier heads) get small random values, so equal "
        "outputs mean something.",
        "",
        f"The causal-LM table is the sweep of {CAUSAL_MEASURED}. The other families were "
        f"measured {OTHERS_MEASURED}, as the table's last column says: each architecture runs in a process of its own on the code of "
        f"the commit it names (records in benchmarks/results/coverage-<family>.jsonl; records from before commits "
        f"were recorded say `?`; a `*` marks a commit whose library, src/, differs from this one's). This file was "
        f"written at commit {commit}. Architectures not measured are named "
        "in their family's section; run the sweep to fill them in.",
        "",
        "| family | architectures | measured | buildable | pass on 2 devices | pass on 3 devices | pass on both | measured on (commits) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    sections: list[str] = []
    for name, records in measured:
        built = [r for r in records if r.get("buildable")]
        both = [r for r in built if all(r.get(str(n), {}).get("ok") for n in WORLDS)]
        ok = {n: sum(1 for r in built if r.get(str(n), {}).get("ok")) for n in WORLDS}
        pct = 100 * len(both) / max(len(built), 1)
        title = FAMILIES[name].title
        total = len(_mapping(name))
        when = CAUSAL_MEASURED if name == "causal-lm" else _measured_when(records)
        lines.append(f"| [{title}](#{title.lower().replace(' ', '-')}) | {total} | {len(records)} | {len(built)} | "
                     f"{ok[2]} | {ok[3]} | {len(both)} ({pct:.1f}%) | {when} |")
        sections += _family_section(name, records)
        print(f"{name}: {len(both)}/{len(built)} buildable architectures pass on 2 and 3 devices ({pct:.1f}%)")
    for name in FAMILIES:
        if name not in dict(measured):
            lines.append(f"| {FAMILIES[name].title} | {len(_mapping(name))} | 0 (not measured yet) | - | - | - | - | - |")
    lines += [
        "",
        "Memory is the largest device's parameter bytes over the unsplit model's. Split: the "
        "groups the plan splits (attention with its head counts, column -> row pairs such as MLPs, channel "
        "groups of ConvNets, the output head, embeddings by vocabulary). Kept whole: layers that fell back, "
        "with the first reason.",
    ]
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    tmp = TABLE.with_suffix(".tmp")
    tmp.write_text("\n".join(lines + sections) + "\n")
    tmp.replace(TABLE)
    print(f"wrote {TABLE}")


def _measured_when(records: list[dict]) -> str:
    """Dates and commits of a family's records, with how many architectures each: "2026-11-24 (abc1234: 40, ?: 2)"."""
    dates = sorted({r["date"] for r in records if r.get("date")}) or ["?"]
    commits: dict[str, int] = {}
    for r in records:
        commits[r.get("commit", "?")] = commits.get(r.get("commit", "?"), 0) + 1
    listed = ", ".join(f"{c}{'' if _same_library(c) else '*'}: {n}"
                       for c, n in sorted(commits.items(), key=lambda kv: -kv[1]))
    return f"{', '.join(dates)} ({listed})"


def _same_library(commit: str) -> bool:
    """Whether src/ at `commit` is the library this file is written with (HEAD's); False when unknown."""
    if commit == "?":
        return False
    try:
        subprocess.run(["git", "diff", "--quiet", commit, "HEAD", "--", "src"], cwd=ROOT, check=True, capture_output=True)
        return True
    except Exception:
        return False


def _mapping(family: str) -> list[str]:
    from transformers.models.auto import modeling_auto

    return sorted(getattr(modeling_auto, FAMILIES[family].mapping))


def _family_section(name: str, records: list[dict]) -> list[str]:
    built = [r for r in records if r.get("buildable")]
    broken = [r for r in records if not r.get("buildable")]
    names = {"preset": "hand-written presets", "translated": "translated base_model_tp_plan",
             "inferred (translated plan did not fit)": "inferred after the translated plan did not fit",
             "inferred": "inferred"}
    sources: dict[str, int] = {}
    for r in built:
        source = names.get(r.get("2", {}).get("plan", "inferred"), "inferred")
        sources[source] = sources.get(source, 0) + 1
    lines = [
        "",
        f"## {FAMILIES[name].title}",
        "",
        f"`{FAMILIES[name].auto_class}` ({FAMILIES[name].mapping}): {len(_mapping(name))} architectures, "
        f"{len(records)} measured" + (f" (not yet: {', '.join(sorted(set(_mapping(name)) - {r['arch'] for r in records}))})"
                                     if len(records) < len(_mapping(name)) else "")
        + f", {len(built)} buildable. Plans used (2 devices): "
        + (", ".join(f"{v} {k}" for k, v in sorted(sources.items(), key=lambda kv: -kv[1])) or "-") + ".",
        "",
        "| architecture | 2 devices | 3 devices | max abs diff | memory (2 / 3) | split | kept whole |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in built:
        cells = []
        for n in WORLDS:
            x = r.get(str(n), {})
            cells.append("pass" if x.get("ok") else "**fail**")
        diffs = [r.get(str(n), {}).get("max_diff") for n in WORLDS]
        diff = max((d for d in diffs if d is not None), default=None)
        mem = " / ".join(f"{100 * r.get(str(n), {}).get('mem_ratio', float('nan')):.0f}%" for n in WORLDS)
        info = r.get("2", {})
        groups = info.get("groups") or {}
        split = ", ".join(f"{v} x {k}" for k, v in sorted(groups.items()))
        if info.get("embeddings"):
            split += (", " if split else "") + f"{info['embeddings']} embedding"
        for part, what in (info.get("parts") or {}).items():  # towers the main input does not reach
            split += (", " if split else "") + f"{part.rsplit('.', 1)[-1]}: {what}"
        if info.get("plan", "inferred") != "inferred":
            split = {"preset": "hand-written preset", "translated": "translated base_model_tp_plan"}.get(info["plan"], info["plan"])
        notes = []
        for n in WORLDS:
            x = r.get(str(n), {})
            if x.get("error"):
                notes.append(f"{n}: {x['error']}")
            elif not x.get("ok") and x:
                why = [w for w, flag in (("logits", "logits_ok"), ("greedy", "greedy_ok"), ("memory", "mem_ok"))
                       if flag in x and not x.get(flag)]
                notes.append(f"{n}: {', '.join(why)} off")
        if name == "image-text-to-text" and "pixel_values" not in r.get("inputs", []):
            notes.insert(0, "text only (no image input built)")
        fb = info.get("fallbacks") or []
        if fb:
            notes.append(f"{len(fb)} fallback(s), e.g. {fb[0]}")
        lines.append(
            f"| {r['arch']} | {cells[0]} | {cells[1]} | {'-' if diff is None else f'{diff:.1e}'} | {mem} | "
            f"{_cell(split or '-')} | {_cell('; '.join(notes) or '-')} |"
        )
    if broken:
        lines += ["", f"Not buildable from a tiny random config ({FAMILIES[name].title}):", "",
                  "| architecture | reason |", "|---|---|"]
        for r in broken:
            lines.append(f"| {r['arch']} | {_cell(r.get('reason', '?'))} |")
    return lines


def _cell(text: str, limit: int = 220) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return "?"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="causal-lm", choices=[*FAMILIES, "all"], help="which mapping to sweep")
    parser.add_argument("--only", nargs="*", help="model types to run (default: all)")
    parser.add_argument("--redo", action="store_true", help="run again even if results exist")
    parser.add_argument("--table", action="store_true", help="only rewrite docs/coverage.md from stored results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # run one architecture, print its record
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    if args.worker:
        print(json.dumps(run_one(args.worker, args.family)), flush=True)
        return
    if not args.table:
        for family in FAMILIES if args.family == "all" else [args.family]:
            types = args.only or _mapping(family)
            sweep(types, args.redo, family)
    write_table()


if __name__ == "__main__":
    sys.exit(main())
