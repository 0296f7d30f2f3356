"""Cases that once gave a wrong answer without an error; each now matches the unsplit model or warns."""

import copy
import logging

import pytest
import torch
from torch import nn

import tensorshard as tp
from support.helpers import check_training_parity, rel_err

pytestmark = pytest.mark.timeout(60)


class ScaledEmbedding(nn.Embedding):
    """An embedding whose class forward does more than look rows up (Gemma, BART, XGLM scale them)."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


@pytest.mark.parametrize("n", [2, 3])
def test_vocab_split_runs_the_embedding_subclass_forward(n, gen):
    ref = nn.Sequential(ScaledEmbedding(19, 8, padding_idx=2), nn.Linear(8, 4))
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n, plan={"0": tp.EmbeddingParallel(split="vocab")})
    check_training_parity(ref, model, lambda: torch.randint(0, 19, (3, 5), generator=gen))


def test_gemma_with_a_vocab_split_tied_embedding_matches(gen):
    transformers = pytest.importorskip("transformers")
    config = transformers.GemmaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )
    torch.manual_seed(0)
    ref = transformers.GemmaForCausalLM(config).eval()
    plan = {
        "model.embed_tokens": tp.EmbeddingParallel(),
        "lm_head": tp.ColwiseParallel(gather_output=True),  # tied to the embedding: split alike
        "model.layers.*.self_attn": tp.Heads(num_heads=4, num_kv_heads=2),
        "model.layers.*.self_attn.q_proj": tp.ColwiseParallel(blocks=("q",)),
        "model.layers.*.self_attn.[kv]_proj": tp.ColwiseParallel(blocks=("kv",)),
        "model.layers.*.self_attn.o_proj": tp.RowwiseParallel(blocks=("q",)),
        "model.layers.*.mlp.[gu]*_proj": tp.ColwiseParallel(),
        "model.layers.*.mlp.down_proj": tp.RowwiseParallel(),
    }
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plan)
    ids = torch.randint(0, 96, (2, 7), generator=gen)
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-5
