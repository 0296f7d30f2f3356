"""The models the decoding benchmarks time (benchmarks/generation.py, generation_torchrun.py): random-weight Llamas
in fp32, built the same way in every process (seed 0), so each process decodes the same tokens.

- "small": hidden 256, 8 layers, 8 heads over 4 KV heads, vocabulary 2048: a token is Python and operator
  dispatch, the regime GPU decoding lives in;
- "smollm": SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads over 3 KV heads, MLP 1536, vocabulary 49152, tied
  embeddings, rope theta 100000): a token reads ~540 MB of weights, so on CPU it is bound by memory bandwidth, the
  regime tensor parallelism is bought for;
- "tiny": a check that a script runs (--quick).

`gpu_shortage` is both scripts' check of `--device cuda` against the GPUs visible, before anything is built.
"""

from __future__ import annotations

MODELS = {
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, tie_word_embeddings=False),
    "smollm": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rms_norm_eps=1e-5,
                   max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False),
}

DESCRIPTIONS = {
    "small": "small Llama (hidden 256, 8 layers, 8 heads / 4 KV heads, vocabulary 2048)",
    "smollm": "SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536, vocabulary 49152, tied "
              "embeddings; random weights)",
    "tiny": "tiny Llama (hidden 64, 2 layers)",
}


def build(name: str):
    """The model `name` (MODELS), random weights from seed 0, fp32, in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if name not in MODELS:
        raise ValueError(f"model {name!r} is not one of the decoding benchmarks' models: choose one of {sorted(MODELS)}")
    torch.manual_seed(0)
    sizes = dict(MODELS[name])
    sizes.setdefault("max_position_embeddings", 2048)
    return LlamaForCausalLM(LlamaConfig(**sizes)).eval()


def gpu_shortage(device: str, flag: str, counts: list[int], gpus: int, need: str) -> str | None:
    """Why `--device` with `flag` (`--devices`, `--ranks`) listing `counts` cannot run with `gpus` visible GPUs, `need`
    saying what each count takes; None: it can."""
    if device != "cuda":
        return None
    if gpus == 0:
        return "--device cuda: no GPU is visible here (torch.cuda.is_available() is False); run it on a CUDA machine"
    if max(counts) > gpus:
        return f"{flag} {' '.join(map(str, counts))}: {need} and {gpus} is visible; pass {flag} up to {gpus}"
    return None
