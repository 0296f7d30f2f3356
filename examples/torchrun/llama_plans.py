"""Tensor-parallel plans for Llama-style transformers models (LlamaForCausalLM and its relatives),
read off the model's config. Shared by the examples in this folder."""

import tensorshard as tp


def llama_plan(config, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> tp.Plan:
    """2 all-reduces per block each way; with `sequence_parallel`, norms run on sequence shards (each
    all-reduce becomes a reduce-scatter plus an all-gather); with `loss_parallel`, logits stay split by
    vocabulary (use tp.vocab_parallel_cross_entropy)."""
    plan = tp.Plan({
        "model.embed_tokens": tp.EmbeddingParallel(),
        "model.layers.*.self_attn": tp.Heads(
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            attrs={"num_key_value_groups": "groups"},  # the attention's local query heads per KV head
        ),
        "model.layers.*.self_attn.q_proj": tp.ColwiseParallel(blocks=("q",)),
        "model.layers.*.self_attn.[kv]_proj": tp.ColwiseParallel(blocks=("kv",)),
        "model.layers.*.self_attn.o_proj": tp.RowwiseParallel(blocks=("q",)),
        "model.layers.*.mlp.[gu]*_proj": tp.ColwiseParallel(),
        "model.layers.*.mlp.down_proj": tp.RowwiseParallel(),
        "lm_head": tp.VocabParallelHead() if loss_parallel else tp.ColwiseParallel(gather_output=True),
    })
    if sequence_parallel:
        plan = plan | {
            # 1. the residual stream is split along the sequence when it enters the first layer
            "model.layers.0": tp.SequenceParallel(input="whole"),
            # 2. norms run on sequence shards; their outputs are gathered for the column-parallel layers
            "model.layers.*.input_layernorm": tp.SequenceParallel(output="gathered"),
            "model.layers.*.post_attention_layernorm": tp.SequenceParallel(output="gathered"),
            "model.norm": tp.SequenceParallel(output="gathered"),
            # 3. row-parallel outputs are reduce-scattered back to sequence shards
            "model.layers.*.self_attn.o_proj": tp.RowwiseToSequence(blocks=("q",)),
            "model.layers.*.mlp.down_proj": tp.RowwiseToSequence(),
        }
    return plan
