"""Dropout in training keeps the shards consistent in one process (comm/dropout.py).

Replicated activations get one mask on every device, so the replicated parameters (norms) stay bit-identical
across devices through training; a model whose dropouts all act on replicated activations trains exactly like
the unsplit model drawing the same keyed masks (losses within 1e-5); activation checkpointing recomputes
with the forward's masks (gradients within 1e-6 of the same run without checkpointing).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T
from torch import nn

import tensorshard as tp
from support.helpers import rel_err
from tensorshard.comm.dropout import ShardDropout

pytestmark = pytest.mark.timeout(120)


def gpt2(attn_pdrop: float = 0.0, **extra):
    torch.manual_seed(0)
    config = T.GPT2Config(vocab_size=96, n_layer=2, n_positions=32, n_embd=72, n_head=9, resid_pdrop=0.1,
                          embd_pdrop=0.1, attn_pdrop=attn_pdrop, **extra)
    return T.GPT2LMHeadModel(config).train()


def ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(seed))


def train(model, steps: int = 3, call=None) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x = ids(step)
        torch.manual_seed(100 + step)  # the call's dropout seed comes from torch's default generator
        loss = (call or model)(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def replicated_copies_differ(model) -> list[str]:
    """Parameters the plan leaves whole on every shard whose copies are not bit-identical."""
    first = dict(model.module_shards[0].named_parameters())
    whole = [name for name in first if model.splits.get(name) is None]
    assert whole  # the norms at least
    return [name for shard in model.module_shards[1:] for name, p in shard.named_parameters()
            if name in whole and not torch.equal(p, first[name])]


@pytest.mark.parametrize("n", [2, 3])
def test_dropout_on_replicated_activations_trains_like_unsplit(n):
    ref = gpt2()
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n, sharded=False)
    dropout = ShardDropout()  # the same keyed masks for the unsplit model: every activation is "replicated"

    def unsplit(**inputs):
        dropout.begin_forward()
        with dropout.mode(0):
            return ref(**inputs)

    want, got = train(ref, call=unsplit), train(model)
    assert want[0] != pytest.approx(train(gpt2().eval())[0])  # the masks matter (eval differs)
    assert got == pytest.approx(want, rel=1e-5)
    assert replicated_copies_differ(model) == []


@pytest.mark.parametrize("n", [2, 3])
def test_dropout_inside_split_attention_keeps_replicated_parameters_identical(n):
    # attention dropout acts on each device's own heads (sdpa with dropout_p, and eager F.dropout): independent
    # masks per device there, one mask for the residual stream
    for implementation in ("sdpa", "eager"):
        model = tp.tensor_parallel(gpt2(attn_pdrop=0.1, attn_implementation=implementation), ["cpu"] * n, sharded=False)
        losses = train(model)
        assert all(torch.isfinite(torch.tensor(losses)))
        assert replicated_copies_differ(model) == [], implementation


def test_bert_encoder_with_default_dropout_stays_consistent():
    torch.manual_seed(0)
    config = T.BertConfig(vocab_size=96, hidden_size=72, intermediate_size=88, num_hidden_layers=2, num_attention_heads=9)
    model = tp.tensor_parallel(T.BertForMaskedLM(config).train(), ["cpu"] * 2, sharded=False)
    train(model)
    assert replicated_copies_differ(model) == []


@pytest.mark.parametrize("n", [2, 3])
def test_activation_checkpointing_recomputes_the_forward_masks(n):
    grads = []
    for checkpointing in (False, True):
        base = gpt2(attn_pdrop=0.1)
        if checkpointing:
            base.gradient_checkpointing_enable()
        model = tp.tensor_parallel(base, ["cpu"] * n, sharded=False)
        x = ids(7)
        torch.manual_seed(3)
        model(input_ids=x, labels=x).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    plain, recomputed = grads
    assert plain.keys() == recomputed.keys()
    for name in plain:
        assert rel_err(recomputed[name], plain[name]) < 1e-6, name


def test_eval_and_no_dropout_models_are_not_intercepted():
    plan = {"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()}
    quiet = tp.tensor_parallel(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.0), nn.Linear(16, 8)), ["cpu"] * 2, plan=plan)
    assert quiet._dropout is None  # nothing to keep consistent: no interception, no cost
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 8))
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plan).eval()
    x = torch.randn(4, 8)
    assert rel_err(model(x), ref.eval()(x)) < 1e-6


def test_attention_dropout_by_its_reference_math_gives_zero_for_rows_that_see_no_key():
    # a left-padded batch masks every key of its padding queries: SDPA gives those rows 0 (and 0 gradients);
    # a softmax over nothing but -inf would give NaN, and the next layer would spread it to every row
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen, requires_grad=True) for _ in range(3))
    keep = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    keep[0, :, :2] = False  # batch row 0: its first two queries see nothing
    dropout = ShardDropout()
    dropout.begin_forward()
    with dropout.mode(0):  # p so small that every weight is kept: the reference math alone
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=1e-12)
    got_grads = torch.autograd.grad(got.sum(), (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    assert torch.equal(got[0, :, :2], torch.zeros_like(got[0, :, :2]))
    assert rel_err(got, want) < 1e-6
    for g, w in zip(got_grads, want_grads):
        assert torch.isfinite(g).all() and rel_err(g, w) < 1e-6


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_attention_dropout_with_a_left_padded_batch_trains_with_finite_numbers(family):
    torch.manual_seed(0)
    if family == "gpt2":
        ref = gpt2(attn_pdrop=0.1)
    else:
        ref = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=96, hidden_size=72, intermediate_size=88, num_hidden_layers=2,
                                               num_attention_heads=6, num_key_value_heads=2, attention_dropout=0.1,
                                               pad_token_id=0)).train()
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, sharded=False)
    x = ids(4)
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # left padding
    labels = x.masked_fill(mask == 0, -100)
    torch.manual_seed(5)
    loss = model(input_ids=x, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():  # without dropout's randomness the split model is the unsplit one
        model.eval(), ref.eval()
        want = ref(input_ids=x, attention_mask=mask, labels=labels).loss
        assert abs(model(input_ids=x, attention_mask=mask, labels=labels).loss - want) < 1e-5 * abs(want)
