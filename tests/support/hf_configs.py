"""Tiny random transformers models, one per preset (and layout variant): two layers, and head counts that do
not divide 2 or 3 devices wherever the architecture allows it (9 query heads in 3 KV groups, as SmolLM2).
Dropout is off: masks cannot match between differently split models."""

from __future__ import annotations

import torch
import transformers as T

VOCAB = 96


def _decoder(config_class, **sizes):
    return lambda: config_class(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, **sizes)


# name -> (config factory, "causal" | "seq2seq")
FAMILIES = {
    "llama": (_decoder(T.LlamaConfig, hidden_size=72, intermediate_size=88, num_attention_heads=9, num_key_value_heads=3), "causal"),
    "mistral": (_decoder(T.MistralConfig, hidden_size=64, intermediate_size=88, num_attention_heads=8, num_key_value_heads=2), "causal"),
    "mixtral": (_decoder(T.MixtralConfig, hidden_size=64, intermediate_size=40, num_attention_heads=8, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2), "causal"),
    "qwen2": (_decoder(T.Qwen2Config, hidden_size=72, intermediate_size=88, num_attention_heads=9, num_key_value_heads=3), "causal"),
    "qwen3": (_decoder(T.Qwen3Config, hidden_size=64, intermediate_size=88, num_attention_heads=6, num_key_value_heads=3, head_dim=16), "causal"),
    # layer 1 has a dense MLP (mlp_only_layers), layer 0 experts
    "qwen3_moe": (_decoder(T.Qwen3MoeConfig, hidden_size=64, intermediate_size=88, moe_intermediate_size=24, num_attention_heads=6, num_key_value_heads=3, head_dim=16, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1]), "causal"),
    "gemma": (_decoder(T.GemmaConfig, hidden_size=64, intermediate_size=88, num_attention_heads=4, num_key_value_heads=1, head_dim=16), "causal"),
    "gemma2": (_decoder(T.Gemma2Config, hidden_size=96, intermediate_size=88, num_attention_heads=6, num_key_value_heads=3, head_dim=16, sliding_window=4), "causal"),
    "phi3": (_decoder(T.Phi3Config, hidden_size=64, intermediate_size=88, num_attention_heads=8, num_key_value_heads=2, pad_token_id=0), "causal"),
    "gpt2": (lambda: T.GPT2Config(vocab_size=VOCAB, n_layer=2, n_positions=64, n_embd=72, n_head=9), "causal"),
    "gpt_neox": (_decoder(T.GPTNeoXConfig, hidden_size=72, intermediate_size=88, num_attention_heads=9), "causal"),
    "gptj": (lambda: T.GPTJConfig(vocab_size=VOCAB, n_layer=2, n_positions=64, n_embd=64, n_head=8, rotary_dim=4), "causal"),
    "opt": (_decoder(T.OPTConfig, hidden_size=64, ffn_dim=88, num_attention_heads=8, word_embed_proj_dim=64), "causal"),
    "bloom": (lambda: T.BloomConfig(vocab_size=VOCAB, n_layer=2, hidden_size=72, n_head=9), "causal"),
    "falcon": (_decoder(T.FalconConfig, hidden_size=64, num_attention_heads=8), "causal"),  # multi-query: 1 KV head
    "falcon_alibi": (_decoder(T.FalconConfig, hidden_size=72, num_attention_heads=9, multi_query=False, alibi=True), "causal"),
    "falcon_new": (_decoder(T.FalconConfig, hidden_size=96, num_attention_heads=12, num_kv_heads=3, new_decoder_architecture=True), "causal"),
    "t5": (lambda: T.T5Config(vocab_size=VOCAB, num_layers=2, d_model=64, d_kv=8, d_ff=88, num_heads=9, decoder_start_token_id=0), "seq2seq"),
    # a decoder with cross-attention: the tests pass encoder_hidden_states (ENCODER_STATES)
    "bert": (_decoder(T.BertConfig, hidden_size=72, intermediate_size=88, num_attention_heads=9, is_decoder=True, add_cross_attention=True), "causal"),
}


ENCODER_STATES = {"bert": (5, 72)}  # (length, width) of the encoder_hidden_states a family's forward needs


def extra_inputs(name: str, batch: int, generator, *, generate: bool = False) -> dict:
    """Inputs besides the token ids that a family's test model needs. Not for bert's generate: in
    transformers 5.23 the unsplit BertLMHeadModel itself cannot generate with encoder_hidden_states (it builds
    a DynamicCache where its cross-attention wants an EncoderDecoderCache), so it generates without them."""
    if name not in ENCODER_STATES or generate:
        return {}
    return {"encoder_hidden_states": torch.randn(batch, *ENCODER_STATES[name], generator=generator)}


def tiny_config(name: str):
    config = FAMILIES[name][0]()
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    return config


def tiny_model(name: str, config=None):
    config = config or tiny_config(name)
    auto = T.AutoModelForSeq2SeqLM if FAMILIES[name][1] == "seq2seq" else T.AutoModelForCausalLM
    return auto.from_config(config).eval()
