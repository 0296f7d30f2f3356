"""Hand-written plans for the models in models.py."""

import tensorshard as tp

FEED_FORWARD = tp.Plan({"w[13]": tp.ColwiseParallel(), "w2": tp.RowwiseParallel()})


def transformer(n_heads: int, n_kv_heads: int) -> tp.Plan:
    return tp.Plan({
        "tok_embeddings": tp.EmbeddingParallel(),
        "layers.*.attn": tp.Heads(
            num_heads=n_heads, num_kv_heads=n_kv_heads, attrs={"n_heads": "heads", "n_kv_heads": "kv_heads"}
        ),
        "layers.*.attn.wq": tp.ColwiseParallel(blocks=("q",)),
        "layers.*.attn.w[kv]": tp.ColwiseParallel(blocks=("kv",)),
        "layers.*.attn.wo": tp.RowwiseParallel(blocks=("q",)),
        "layers.*.ffn.w[13]": tp.ColwiseParallel(),
        "layers.*.ffn.w2": tp.RowwiseParallel(),
        "output": tp.ColwiseParallel(gather_output=True),
    })


CONV_NET = tp.Plan({
    "conv1": tp.ColwiseParallel(),
    "conv2": tp.RowwiseParallel(),
    "conv3": tp.ColwiseParallel(),
    "conv4": tp.RowwiseParallel(),
})

# Two column -> row pairs (models.TwoBlocks), as a plain dict.
TWO_BLOCKS = {"a[12]": tp.ColwiseParallel(), "b[12]": tp.RowwiseParallel()}
