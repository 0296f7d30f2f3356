"""Multi-query attention (one key/value head) in inferred plans: its query heads split, the single KV head
replicated on every device, as with fewer KV heads than devices.

RoPE (Llama) or a per-head norm (Gemma3's k_norm) joins every feature of a one-head k_proj into one unit
before attention reads it; the trace used to stop following such a column at once ("nothing is left to
split"), so attention stayed whole with no fallback in the log (plan_inference/collapses.py)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers as T

import tensorshard as tp
from support.helpers import rel_err, split_copy, train_both_causal_lm
from tensorshard.plan_inference.infer import infer
from tensorshard.styles import ColwiseParallel, Heads, RowwiseParallel

VOCAB = 301
ATTN = "model.layers.0.self_attn"


def _llama(kv: int = 1, heads: int = 4):
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=16, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )).eval()


def _gemma3(kv: int = 1):
    return T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv, head_dim=16, pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )).eval()


def _split(family: str, ref, n: int):
    """Llama has a preset: its inferred plan is passed explicitly. Gemma3 has none (its translated plan fails
    the self-check): tensor_parallel's default plan is the inferred one."""
    if family == "llama":
        return split_copy(ref, n, plan=tp.infer_plan(ref, n, check=True))
    return split_copy(ref, n)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_one_kv_head_splits_query_heads_exactly(family, n):
    ref = {"llama": _llama, "gemma3": _gemma3}[family]()
    model = _split(family, ref, n)
    plan = dict(model.plan.items())
    heads = next(s for p, s in plan.items() if p.endswith("self_attn") and isinstance(s, Heads))
    assert (heads.num_heads, heads.num_kv_heads) == (4, 1)
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.self_attn.o_proj"], RowwiseParallel)
    # Every device holds its query heads only, and the whole (replicated) key/value head.
    q_rows = [s.get_parameter(f"{ATTN}.q_proj.weight").shape[0] for s in model.module_shards]
    o_cols = [s.get_parameter(f"{ATTN}.o_proj.weight").shape[1] for s in model.module_shards]
    k_rows = [s.get_parameter(f"{ATTN}.k_proj.weight").shape[0] for s in model.module_shards]
    assert q_rows == o_cols == [16 * h for h in ([2, 2] if n == 2 else [2, 1, 1])]
    assert k_rows == [16] * n

    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, VOCAB, (2, 7), generator=g)
    with torch.no_grad():
        assert rel_err(model(input_ids=x).logits, ref(input_ids=x).logits) < 1e-5
        prompt = x[:1, :4]
        kwargs = dict(max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(prompt, **kwargs), ref.generate(prompt, **kwargs))

    model.train()
    ref.train()
    batches = [torch.randint(1, VOCAB, (2, 7), generator=g) for _ in range(3)]
    for split_loss, loss in train_both_causal_lm(model, ref, batches):
        assert abs(split_loss - loss) <= 1e-4 * abs(loss)


def test_one_head_attention_says_why_it_stays_whole(caplog):
    """One query head and one KV head: nothing to split, and the log says so (it counted no fallback)."""
    ref = _llama(kv=1, heads=1)
    with caplog.at_level(logging.INFO, logger="tensorshard.plan_inference.infer"):
        plan = tp.infer_plan(ref, 2)
    assert "self_attn" not in str(plan)
    assert "2 fallback(s)" in caplog.text  # one per layer
    assert f"kept whole (structure): {ATTN}.q_proj" in caplog.text
    assert "nothing is left to split" in plan.whole[f"{ATTN}.q_proj"]


def test_a_norm_over_a_whole_column_still_stops_it():
    """A single unit nothing needs (a Linear whose features a LayerNorm mixes) stays whole, and the Linear
    after it is a column of its own: the pending collapse fails when the next layer reads it."""
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16),
    )
    report = infer(copy.deepcopy(model), 2)
    entries = dict(report.plan.items())
    assert "0" not in entries
    assert isinstance(entries["2"], ColwiseParallel) and isinstance(entries["4"], RowwiseParallel)
    assert "nothing is left to split" in report.plan.whole["0"]
