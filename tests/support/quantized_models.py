"""Tiny random Llamas saved once, loaded quantized by transformers as a user would, and the bytes they hold.

Sizes keep 4-bit blocks (64 values) whole at 2 and 3 devices: hidden 192 = 3 * 64, 6 query heads of 32 in
3 KV groups (GQA; uneven 2 + 1 KV heads at 2 devices), MLP width 384.
"""

from __future__ import annotations

import torch
import transformers as T

ALIGNED = dict(hidden_size=192, intermediate_size=384, num_attention_heads=6, num_key_value_heads=3, head_dim=32)
# 4 query heads of 64 in 2 KV groups: at 4 devices each KV head is held by 2 devices (replicated KV heads)
FEW_KV_HEADS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
# the suite's usual tiny Llama (tests/hf/configs.py): 72 features, 9 heads of 8, MLP width 88
UNALIGNED = dict(hidden_size=72, intermediate_size=88, num_attention_heads=9, num_key_value_heads=3)


def save_llama(path, **sizes) -> str:
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=128, num_hidden_layers=2, max_position_embeddings=64, **sizes)
    T.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def quant_config(bits: int, quant_type: str = "nf4", double: bool = False) -> T.BitsAndBytesConfig:
    if bits == 8:
        return T.BitsAndBytesConfig(load_in_8bit=True)
    return T.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double)


def load(path, bits: int | None, quant_type: str = "nf4", double: bool = False):
    """The saved model in eval mode, quantized by transformers (bits None: full precision)."""
    config = None if bits is None else quant_config(bits, quant_type, double)
    model = T.AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu")
    return float_kernel(model.eval())


def float_kernel(model):
    """Run 4-bit layers through bitsandbytes' float kernel, as split layers do (quant/__init__.py,
    finish_module): on AVX512-BF16 CPUs its eval-mode default is a bf16 kernel."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def random_ids(gen: torch.Generator, batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=gen)


def quantized_layer_bytes(module) -> int:
    """Bytes of the 4/8-bit layers' weights and quantization state, counted from bitsandbytes' own fields."""
    import bitsandbytes as bnb

    total = 0
    for m in module.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, bnb.nn.Params4bit):
            total += w.numel() * w.element_size()
            states = [w.quant_state, w.quant_state.state2]
            for s in filter(None, states):
                total += sum(t.numel() * t.element_size() for t in (s.absmax, s.code, s.offset) if t is not None)
        elif isinstance(w, bnb.nn.Int8Params):
            scb = w.SCB if w.SCB is not None else m.state.SCB
            total += w.numel() * w.element_size() + scb.numel() * scb.element_size()
    return total
