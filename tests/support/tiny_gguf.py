"""A GGUF file (llama.cpp's format) of a tiny transformers Llama, written with the `gguf` package.

Names, metadata and the q/k row order follow llama.cpp's converter, so transformers' own GGUF loader
reads it back (`LlamaForCausalLM.from_pretrained(folder, gguf_file=...)`). Projections whose rows are a
multiple of 32 values are quantized to Q8_0; the rest stay float32.
"""

from pathlib import Path

import numpy as np
import pytest

LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows of each head as (pairs, 2) instead of (2, pairs): transformers undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path) -> Path:
    gguf = pytest.importorskip("gguf")  # the test that writes one is skipped where the package is missing

    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_vocab_size(c.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<{i}>".encode() for i in range(c.vocab_size)])
    writer.add_token_scores([0.0] * c.vocab_size)
    writer.add_token_types([1] * c.vocab_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(c.num_hidden_layers):
        names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for hf, g in LAYER_NAMES.items()})
    state = model.state_dict()
    for hf_name, gguf_name in names.items():
        w = state[hf_name].float().numpy()
        if "q_proj" in hf_name:
            w = _permute(w, c.num_attention_heads)
        elif "k_proj" in hf_name:
            w = _permute(w, c.num_key_value_heads)
        w = np.ascontiguousarray(w)
        if w.ndim == 2 and w.shape[1] % 32 == 0 and "embd" not in gguf_name:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
