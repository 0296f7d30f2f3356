"""Presets for encoder and encoder-decoder models of transformers: t5 and bert.

T5: the shared embedding (tied to both stacks' embed_tokens and, by default, to lm_head) is split by
vocabulary. Self- and cross-attention split by heads; the relative position bias table (buckets, heads) is
split by heads too, so the bias computed in a stack's first layer and passed on to the others holds exactly
this device's heads. The feed-forward (wi or the gated wi_0 / wi_1, then wo) is a column -> row pair.

BERT: the attention's projections live in ``attention.self`` and its output projection in
``attention.output``, so the `Heads` entry sits on ``attention``, the module enclosing both.
"""

from __future__ import annotations

from ...styles import ColwiseParallel, EmbeddingParallel, Heads, RowwiseParallel, ShardParams
from ..plan import Plan
from .registry import preset


@preset("t5", "mt5")
def t5(config) -> Plan:
    heads = Heads(num_heads=config.num_heads, head_dim=config.d_kv, attrs={"n_heads": "heads", "inner_dim": "features"})
    plan = {
        "shared": EmbeddingParallel(),
        "*.embed_tokens": EmbeddingParallel(),  # the same tensor as shared.weight: split alike
    }
    for attention in ("SelfAttention", "EncDecAttention"):  # EncDecAttention: decoder layers only
        at = f"*.block.*.layer.*.{attention}"
        plan |= {
            at: heads,
            f"{at}.q": ColwiseParallel(blocks=("q",)),
            f"{at}.[kv]": ColwiseParallel(blocks=("kv",)),
            f"{at}.o": RowwiseParallel(blocks=("q",)),
        }
    # The relative position bias (first self-attention of each stack): its (buckets, heads) table keeps this
    # device's head columns; the bias it computes is used as is, no collective.
    plan["*.block.*.layer.*.SelfAttention.relative_attention_bias"] = ShardParams(
        params={"weight": {"dim": 1, "blocks": ["q"]}}, input="split", output="split"
    )
    plan |= {
        "*.block.*.layer.*.DenseReluDense.wi*": ColwiseParallel(),  # wi, or the gated wi_0 and wi_1
        "*.block.*.layer.*.DenseReluDense.wo": RowwiseParallel(),
    }
    return Plan(plan)


@preset("bert", "roberta")
def bert(config) -> Plan:
    heads = Heads(
        num_heads=config.num_attention_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        attrs={"self.num_attention_heads": "heads", "self.all_head_size": "features"},
    )
    layer = "encoder.layer.*"
    plan = {"embeddings.word_embeddings": EmbeddingParallel()}  # positions and token types stay whole
    for attention in ("attention", "crossattention"):  # crossattention: decoders with add_cross_attention
        plan |= {
            f"{layer}.{attention}": heads,
            f"{layer}.{attention}.self.query": ColwiseParallel(blocks=("q",)),
            f"{layer}.{attention}.self.key": ColwiseParallel(blocks=("kv",)),
            f"{layer}.{attention}.self.value": ColwiseParallel(blocks=("kv",)),
            f"{layer}.{attention}.output.dense": RowwiseParallel(blocks=("q",)),
        }
    plan |= {f"{layer}.intermediate.dense": ColwiseParallel(), f"{layer}.output.dense": RowwiseParallel()}
    return Plan(plan)
