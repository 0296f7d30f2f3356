"""Dropout in training under torchrun (comm/dropout.py): one mask per replicated activation on every rank, even
when the ranks' generators were seeded differently; the replicated parameters stay bit-identical across ranks;
a model whose dropouts act on replicated activations trains like the unsplit model drawing the same keyed
masks (losses within 1e-5); activation checkpointing recomputes the forward's masks (gradients within 1e-6).
GPT-2 with 9 heads: uneven over 2 and 3 ranks, so the ranks' own generators would fall out of step too."""

import copy

import pytest
import torch
import torch.distributed as dist
import transformers as T

import tensorshard as tp
from support.harness import world_mesh
from support.helpers import rel_err
from tensorshard.comm.dropout import ShardDropout

pytestmark = pytest.mark.timeout(180)


def gpt2(attn_pdrop: float) -> T.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = T.GPT2Config(vocab_size=96, n_layer=2, n_positions=32, n_embd=72, n_head=9, resid_pdrop=0.1,
                          embd_pdrop=0.1, attn_pdrop=attn_pdrop)
    return T.GPT2LMHeadModel(config).train()


def ids(step: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(step))


def train(model, call=None, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step + 1000 * dist.get_rank())  # each rank its own stream: rank 0's seed is used
        loss = (call or model)(input_ids=ids(step), labels=ids(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def replicated_max_difference(model) -> float:
    """Largest difference between ranks of the parameters every rank holds whole."""
    worst = 0.0
    for name, p in model.named_parameters():
        if model.tensorshard.splits.get(name) is None:
            local = (p.to_local() if hasattr(p, "to_local") else p).detach().contiguous()
            copies = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(copies, local)
            worst = max(worst, max((c - copies[0]).abs().max().item() for c in copies))
    return worst


def dropout_task() -> dict:
    ref = gpt2(attn_pdrop=0.0)  # dropout on the residual stream only: all replicated
    model = tp.parallelize(copy.deepcopy(ref), world_mesh())
    got = train(model)
    result = {"got": got, "replicated": replicated_max_difference(model), "reference": []}
    if dist.get_rank() == 0:  # the calls used rank 0's seeds: its own draws after the same manual_seed calls
        keyed = ShardDropout()  # the unsplit model with the same keyed masks

        def unsplit(**inputs):
            keyed.begin_forward()
            with keyed.mode():
                return ref(**inputs)

        result["reference"] = train(ref, call=unsplit)
    return result


@pytest.mark.parametrize("world", [2, 3])
def test_replicated_dropout_is_one_mask_on_every_rank(pool2, pool3, world):
    pool = pool2 if world == 2 else pool3
    results = pool.run(dropout_task)
    for r in results:
        assert r["replicated"] == 0.0
        assert r["got"] == results[0]["got"]  # one loss on every rank
    assert results[0]["got"] == pytest.approx(results[0]["reference"], rel=1e-5)


def attention_dropout_task() -> dict:
    model = tp.parallelize(gpt2(attn_pdrop=0.1), world_mesh())  # split heads: a mask per rank there
    train(model)
    return {"replicated": replicated_max_difference(model)}


def test_dropout_inside_split_attention_keeps_replicated_parameters_identical(pool2):
    for r in pool2.run(attention_dropout_task):
        assert r["replicated"] == 0.0


def checkpointing_task() -> dict:
    grads = []
    for checkpointing in (False, True):
        base = gpt2(attn_pdrop=0.1)
        if checkpointing:
            base.gradient_checkpointing_enable()
        model = tp.parallelize(base, world_mesh())
        torch.manual_seed(3)
        model(input_ids=ids(7), labels=ids(7)).loss.backward()
        grads.append({n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for n, p in model.named_parameters()
                      if p.grad is not None})
    return {n: rel_err(grads[1][n], grads[0][n]) for n in grads[0]}


def test_activation_checkpointing_recomputes_the_forward_masks(pool2):
    for errors in pool2.run(checkpointing_task):
        assert errors and max(errors.values()) < 1e-6, errors
