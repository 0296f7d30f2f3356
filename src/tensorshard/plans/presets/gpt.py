"""Presets for the GPT-style decoders of transformers: gpt2, gptj, gpt_neox, opt, bloom and falcon.

Same Megatron layout as the Llama family (attention column -> row, MLP column -> row, two all-reduces per
block), but fused projections are common here, each with its own layout of the output features:

    gpt2 c_attn         [q | k | v], each all heads               blocks ("q", "kv", "kv")
    gpt_neox, bloom     per head: q, k, v of that head            blocks ("q*3",)
    falcon (classic)    per head: q, k, v of that head            blocks ("q*3",)
    falcon (multi-query)[q (all heads) | k | v] with one KV head  blocks ("q", "kv", "kv"), KV replicated
    falcon (new arch.)  per KV group: its G query heads, k, v     blocks ("kv*(G+2)",), whole groups only

BLOOM (and Falcon with alibi=True) build the ALiBi bias for every head outside the attention (Falcon also
folds it into the attention mask): each device keeps its own heads' slice (`AttentionHeads(head_inputs=...)`).
"""

from __future__ import annotations

from ...styles import ColwiseParallel, EmbeddingParallel, Heads, RowwiseParallel
from ...styles.attention_heads import AttentionHeads
from ..plan import Plan
from .registry import preset


def _pair(first: str, second: str) -> dict:
    """A column -> row pair (an MLP, or an attention's fused projection -> output projection)."""
    return {first: ColwiseParallel(), second: RowwiseParallel()}


@preset("gpt2")
def gpt2(config) -> Plan:
    # GPT2Attention splits c_attn's output with split_size (features of q) and reshapes with num_heads.
    heads = Heads(
        num_heads=config.n_head,
        head_dim=config.n_embd // config.n_head,
        attrs={"num_heads": "heads", "split_size": "features"},
    )
    return Plan({
        "wte": EmbeddingParallel(),  # wpe (positions) stays whole
        "h.*.attn": heads,
        "h.*.attn.c_attn": ColwiseParallel(blocks=("q", "kv", "kv")),
        "h.*.attn.c_proj": RowwiseParallel(blocks=("q",)),
        **_pair("h.*.mlp.c_fc", "h.*.mlp.c_proj"),
    })


@preset("gptj")
def gptj(config) -> Plan:
    return Plan({
        "wte": EmbeddingParallel(),
        "h.*.attn": Heads(num_heads=config.n_head, attrs={"num_attention_heads": "heads"}),
        "h.*.attn.[qkv]_proj": ColwiseParallel(blocks=("q",)),
        "h.*.attn.out_proj": RowwiseParallel(blocks=("q",)),
        **_pair("h.*.mlp.fc_in", "h.*.mlp.fc_out"),
    })


@preset("gpt_neox")
def gpt_neox(config) -> Plan:
    # GPTNeoXAttention reshapes with (..., -1, 3 * head_size): no head count to set.
    return Plan({
        "embed_in": EmbeddingParallel(),
        "layers.*.attention": Heads(num_heads=config.num_attention_heads),
        "layers.*.attention.query_key_value": ColwiseParallel(blocks=("q*3",)),
        "layers.*.attention.dense": RowwiseParallel(blocks=("q",)),
        **_pair("layers.*.mlp.dense_h_to_4h", "layers.*.mlp.dense_4h_to_h"),
    })


@preset("opt")
def opt(config) -> Plan:
    # project_in / project_out (when word_embed_proj_dim != hidden_size) and the positions stay whole.
    return Plan({
        "decoder.embed_tokens": EmbeddingParallel(),
        "decoder.layers.*.self_attn": Heads(num_heads=config.num_attention_heads, attrs={"num_heads": "heads"}),
        "decoder.layers.*.self_attn.[qkv]_proj": ColwiseParallel(blocks=("q",)),
        "decoder.layers.*.self_attn.out_proj": RowwiseParallel(blocks=("q",)),
        **_pair("decoder.layers.*.fc1", "decoder.layers.*.fc2"),
    })


@preset("bloom")
def bloom(config) -> Plan:
    heads = AttentionHeads(
        num_heads=config.n_head,
        head_dim=config.hidden_size // config.n_head,
        attrs={"num_heads": "heads", "hidden_size": "features", "split_size": "features"},
        head_inputs={"alibi": "batch*heads"},  # (batch * heads, 1, keys), built for all heads
    )
    return Plan({
        "word_embeddings": EmbeddingParallel(),
        "h.*.self_attention": heads,
        "h.*.self_attention.query_key_value": ColwiseParallel(blocks=("q*3",)),
        "h.*.self_attention.dense": RowwiseParallel(blocks=("q",)),
        **_pair("h.*.mlp.dense_h_to_4h", "h.*.mlp.dense_4h_to_h"),
    })


@preset("falcon")
def falcon(config) -> Plan:
    n_heads = config.num_attention_heads
    if config.new_decoder_architecture:
        n_kv = config.num_kv_heads
        blocks = (f"kv*{n_heads // n_kv + 2}",)  # per KV group: G query heads, then k, then v
    elif config.multi_query:
        n_kv, blocks = 1, ("q", "kv", "kv")  # one KV head, replicated on every device
    else:
        n_kv, blocks = n_heads, ("q*3",)
    heads = AttentionHeads(
        num_heads=n_heads,
        num_kv_heads=n_kv,
        attrs={"num_heads": "heads", "num_kv_heads": "kv_heads"},
        # FalconModel reshapes ALiBi to (batch, heads, 1, keys) and folds it into the mask (batch, heads, q, k)
        head_inputs={"alibi": "heads", "attention_mask": "heads"} if config.alibi else {},
        whole_kv_groups=bool(config.new_decoder_architecture),
    )
    return Plan({
        "word_embeddings": EmbeddingParallel(),
        "h.*.self_attention": heads,
        "h.*.self_attention.query_key_value": ColwiseParallel(blocks=blocks),
        "h.*.self_attention.dense": RowwiseParallel(blocks=("q",)),
        **_pair("h.*.mlp.dense_h_to_4h", "h.*.mlp.dense_4h_to_h"),
    })
