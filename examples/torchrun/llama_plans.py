"""Sequence parallelism and a vocabulary-parallel loss on top of tensorshard's preset for Llama-style
transformers models (LlamaForCausalLM and its relatives). Shared by the examples in this folder."""

import tensorshard as tp


def llama_plan(model, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> tp.Plan:
    """The preset (2 all-reduces per block each way: what ``tp.parallelize(model, mesh)`` uses by itself);
    with `sequence_parallel`, norms run on sequence shards (each all-reduce becomes a reduce-scatter plus an
    all-gather); with `loss_parallel`, logits stay split by vocabulary (use tp.vocab_parallel_cross_entropy)."""
    plan = tp.preset_for(model)
    if loss_parallel:
        plan = plan | {"lm_head": tp.VocabParallelHead()}
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
