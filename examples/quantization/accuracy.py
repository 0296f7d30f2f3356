"""The numbers in docs/quantization.md: how far split 4-bit and 8-bit models are from the unsplit quantized
model and from full precision, and what each device holds.

    python examples/quantization/accuracy.py            # ~1 minute on CPU; prints a markdown table

A random Llama (hidden 192, MLP 384, 6 query heads of 32 in 3 KV groups, 2 layers, vocabulary 128) is
saved once, then loaded by transformers in full precision and quantized; each quantized model is split
over 2 and 3 CPU slots. Errors are relative (norm of the difference / norm of the reference) on the logits
of 2 random sequences of 9 tokens. 4-bit layers run bitsandbytes' float kernel in both the split and the
unsplit model (docs/quantization.md: the CPU bf16 kernel).
"""

from __future__ import annotations

import tempfile

import torch
import transformers as T

import tensorshard as tp


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def load(path: str, config):
    model = T.AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu").eval()
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def main() -> None:
    torch.manual_seed(0)
    path = tempfile.mkdtemp()
    config = T.LlamaConfig(vocab_size=128, hidden_size=192, intermediate_size=384, num_hidden_layers=2,
                           num_attention_heads=6, num_key_value_heads=3, head_dim=32, max_position_embeddings=64)
    T.LlamaForCausalLM(config).save_pretrained(path)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = load(path, None)(ids).logits
    setups = {
        "NF4": T.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
        "NF4, double quant.": T.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
        "FP4": T.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
        "FP4, double quant.": T.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True),
        "int8 (LLM.int8())": T.BitsAndBytesConfig(load_in_8bit=True),
    }
    print("| quantization | devices | vs unsplit quantized | vs full precision | bytes per device (whole model) |")
    print("|---|---|---|---|---|")
    for name, qconfig in setups.items():
        with torch.no_grad():
            unsplit = load(path, qconfig)
            ref = unsplit(ids).logits
            print(f"| {name} | 1 | - | {rel(ref, full):.2e} | {tp.memory_per_device(unsplit)['cpu']:,} |")
            for n in (2, 3):
                split = tp.tensor_parallel(load(path, qconfig), ["cpu"] * n)
                out = split(ids).logits
                mem = " / ".join(f"{b:,}" for b in split.memory_per_device().values())
                print(f"| {name} | {n} | {rel(out, ref):.2e} | {rel(out, full):.2e} | {mem} |")


if __name__ == "__main__":
    main()
