"""Multi-query attention (Gemma3 text, one KV head) under torchrun with the automatic plan: the inferred plan
splits the query heads and keeps the KV head whole on each rank, as the in-process engine does
(tests/plan_inference/test_multi_query.py); logits, three AdamW steps and greedy tokens match the unsplit model."""

import copy

import pytest
import torch
import transformers as T

import tensorshard as tp
from support.harness import world_mesh
from support.helpers import rel_err, train_both_causal_lm

pytestmark = pytest.mark.timeout(180)

VOCAB = 301


def mqa_task() -> dict:
    torch.manual_seed(0)
    ref = T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )).eval()
    model = tp.parallelize(copy.deepcopy(ref), world_mesh(), check_inputs=0)
    plan = dict(model.tensorshard.plan.items())
    attn = model.get_submodule("model.layers.0.self_attn")
    out = {
        "heads": repr(plan.get("model.layers.*.self_attn")),
        "local": [tuple(attn.q_proj.weight.to_local().shape), tuple(attn.k_proj.weight.to_local().shape)],
    }
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, VOCAB, (2, 7), generator=g)
    with torch.no_grad():
        out["logits"] = rel_err(model(input_ids=x).logits, ref(input_ids=x).logits)
        settings = dict(max_new_tokens=6, do_sample=False)
        out["greedy"] = torch.equal(model.generate(x[:1, :4], **settings), ref.generate(x[:1, :4], **settings))
    model.train(), ref.train()
    pairs = train_both_causal_lm(model, ref, [torch.randint(1, VOCAB, (2, 7), generator=g) for _ in range(3)])
    out["losses"] = max(abs(split - unsplit) / abs(unsplit) for split, unsplit in pairs)
    return out


def test_one_kv_head_splits_query_heads_under_torchrun(pool2):
    for out in pool2.run(mqa_task, timeout=150):
        assert "num_heads=4, num_kv_heads=1" in out["heads"]
        assert out["local"] == [(32, 64), (16, 64)]  # 2 of 4 query heads; the one KV head, whole
        assert out["logits"] < 1e-5 and out["greedy"] and out["losses"] < 1e-4
