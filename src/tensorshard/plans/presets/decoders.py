"""Presets for the Llama-style decoders of transformers: llama, mistral, qwen2, qwen3, gemma, gemma2, phi3, and
the mixture-of-experts mixtral and qwen3_moe.

Every block is the Megatron pair twice: q, k, v column-parallel on head boundaries and o_proj row-parallel
(one all-reduce), then the MLP's gate and up column-parallel and down_proj row-parallel (one all-reduce).
Patterns are relative to the base model (`LlamaModel`); `preset_for` adds the prefix and the output head.

The attention forwards of transformers 5.x reshape with ``view(..., -1, head_dim)``, so the only head count
they read is ``num_key_value_groups`` (query heads per KV head, for ``repeat_kv``). Phi-3 slices its fused
q|k|v output with ``config.num_attention_heads`` and ``num_key_value_heads``, so it sets those too.
"""

from __future__ import annotations

from ...styles import ColwiseParallel, EmbeddingParallel, Heads, RowwiseParallel, ShardParams, SumGradients
from ..plan import Plan
from .registry import preset


def _attention(config, **extra_attrs: str) -> dict:
    return {
        "layers.*.self_attn": Heads(
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            attrs={"num_key_value_groups": "groups", **extra_attrs},
        ),
        "layers.*.self_attn.q_proj": ColwiseParallel(blocks=("q",)),
        "layers.*.self_attn.[kv]_proj": ColwiseParallel(blocks=("kv",)),
        "layers.*.self_attn.o_proj": RowwiseParallel(blocks=("q",)),
    }


GATED_MLP = {
    "layers.*.mlp.gate_proj": ColwiseParallel(),
    "layers.*.mlp.up_proj": ColwiseParallel(),
    "layers.*.mlp.down_proj": RowwiseParallel(),
}


def _experts(intermediate: int) -> ShardParams:
    """Fused experts, 3-D parameters (transformers 5.x): every expert's hidden features are split, so
    gate_up_proj (E, 2I, H) is split along dim 1 in its gate and up halves, down_proj (E, H, I) along dim 2;
    the expert outputs are partial sums (one all-reduce). The router stays whole on every device."""
    return ShardParams(params={"gate_up_proj": {"dim": 1, "blocks": [intermediate, intermediate]}, "down_proj": 2})


# Qwen3 normalises q and k per head (over head_dim) with one weight shared by all heads: each device applies
# it to its own heads, so its gradient is a partial sum.
QK_NORMS = {"layers.*.self_attn.[qk]_norm": SumGradients()}


@preset("llama", "mistral", "qwen2", "gemma", "gemma2")
def llama(config) -> Plan:
    # gemma's scaled embedding multiplies the looked-up rows by a constant, which commutes with the split.
    return Plan({"embed_tokens": EmbeddingParallel(), **_attention(config), **GATED_MLP})


@preset("qwen3")
def qwen3(config) -> Plan:
    return Plan({"embed_tokens": EmbeddingParallel(), **_attention(config), **QK_NORMS, **GATED_MLP})


@preset("mixtral")
def mixtral(config) -> Plan:
    return Plan({
        "embed_tokens": EmbeddingParallel(),
        **_attention(config),
        "layers.*.mlp.experts": _experts(config.intermediate_size),
    })


@preset("qwen3_moe")
def qwen3_moe(config) -> Plan:
    # Layers listed in mlp_only_layers (or off the decoder_sparse_step) have a dense MLP instead of experts;
    # an entry that matches no layer is dropped by preset_for.
    return Plan({
        "embed_tokens": EmbeddingParallel(),
        **_attention(config),
        **QK_NORMS,
        "layers.*.mlp.experts": _experts(config.moe_intermediate_size),
        **GATED_MLP,
    })


@preset("phi3")
def phi3(config) -> Plan:
    heads = Heads(
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        attrs={
            "num_key_value_groups": "groups",
            "num_key_value_heads": "kv_heads",
            "config.num_attention_heads": "heads",  # query_pos = config.num_attention_heads * head_dim
        },
    )
    return Plan({
        "embed_tokens": EmbeddingParallel(),
        "layers.*.self_attn": heads,
        "layers.*.self_attn.qkv_proj": ColwiseParallel(blocks=("q", "kv", "kv")),  # [q | k | v] concatenated
        "layers.*.self_attn.o_proj": RowwiseParallel(blocks=("q",)),
        # gate_up_proj's output is [gate | up], halved by chunk(2): split each half on its own.
        "layers.*.mlp.gate_up_proj": ColwiseParallel(blocks=(config.intermediate_size, config.intermediate_size)),
        "layers.*.mlp.down_proj": RowwiseParallel(),
    })
