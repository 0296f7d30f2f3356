"""A tiny random Llama (transformers) and its tensor-parallel plans (the preset, and a sequence-parallel one), for the torchrun tests.

hidden 64, 2 layers, 4 query heads over 2 KV heads (grouped-query attention), MLP width 176, vocabulary
128. On 4 ranks each KV head is replicated on two ranks; the MLP splits 44 per rank.
"""

import torch

import tensorshard as tp

VOCAB = 128


def build(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM  # imported here: slow, and not every task needs it

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=128, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def plan(head=None) -> tp.Plan:
    """The llama preset (2 all-reduces per block each way; the head gathers its logits unless told otherwise)."""
    preset = tp.preset_for(build())
    return preset | {"lm_head": head} if head is not None else preset


def sequence_parallel_plan(head=tp.VocabParallelHead()) -> tp.Plan:
    """Sequence parallelism between the blocks and, by default, a vocabulary-parallel head (loss parallelism);
    `head=None`: the preset's head, which gathers its logits."""
    return plan(head=head) | {
        "model.layers.0": tp.SequenceParallel(input="whole"),  # the residual stream is split from here on
        "model.layers.*.input_layernorm": tp.SequenceParallel(output="gathered"),
        "model.layers.*.post_attention_layernorm": tp.SequenceParallel(output="gathered"),
        "model.layers.*.self_attn.o_proj": tp.RowwiseToSequence(blocks=("q",)),
        "model.layers.*.mlp.down_proj": tp.RowwiseToSequence(),
        "model.norm": tp.SequenceParallel(output="gathered"),
    }


def build_uneven_heads(kv_heads: int = 3, seed: int = 0):
    """A tiny Llama whose heads split unevenly (the balanced split's case, plans/balance.py): hidden 96, 2 layers,
    6 query heads of 16 features over `kv_heads` KV heads (3: 2 + 1 KV groups at 2 devices, SmolLM2's case; 2:
    KV head 0 shared by devices 0 and 1 at 3 devices), MLP width 256, vocabulary 128."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=kv_heads,
        head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()
