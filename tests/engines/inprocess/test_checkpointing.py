"""Activation checkpointing inside a split model: each shard recomputes its blocks in its own backward pass,
meeting the other shards at the recomputed collectives. Gradients are those of the split model without
checkpointing, to the bit, and match the unsplit model with the same checkpointing; each device keeps far
fewer activations for backward."""

from contextlib import contextmanager

import pytest
import torch

import tensorshard as tp
from support.helpers import rel_err, split_copy
from support.hf_parity import gathered_grads
from support.models import ResidualStack

pytestmark = pytest.mark.timeout(60)

PLAN = {"blocks.*.up": tp.ColwiseParallel(), "blocks.*.down": tp.RowwiseParallel()}
DIM, HIDDEN, LAYERS = 16, 64, 4


def step(model, x):
    """Output, input gradient and parameter gradients of one backward pass of `model` from `x`."""
    x = x.clone().requires_grad_()
    out = model(x)
    out.square().mean().backward()
    return out.detach(), x.grad, gathered_grads(model) if hasattr(model, "module_shards") else {
        k: p.grad for k, p in model.named_parameters()
    }


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("n, sharded", [(2, False), (3, False), (2, True)])
def test_checkpointed_blocks_match_the_unsplit_model(reentrant, n, sharded, gen):
    # sharded: ZeRO-3 partitions the norms (the default when training); a recomputed block gathers its own.
    ref = ResidualStack(DIM, HIDDEN, LAYERS, reentrant=reentrant)
    plain = split_copy(ref, n, plan=PLAN, sharded=sharded)
    plain.module_shards.apply(lambda m: setattr(m, "reentrant", None) if isinstance(m, ResidualStack) else None)
    model = split_copy(ref, n, plan=PLAN, sharded=sharded)
    x = torch.randn(3, 5, DIM, generator=gen)
    with tp.count_collectives() as counted:
        out, x_grad, grads = step(model, x)
    plain_out, plain_x_grad, plain_grads = step(plain, x)
    # The split model with checkpointing is the split model without it, to the bit...
    assert torch.equal(out, plain_out) and torch.equal(x_grad, plain_x_grad)
    assert grads.keys() == plain_grads.keys() and all(torch.equal(grads[k], plain_grads[k]) for k in grads)
    # ... and matches the unsplit model with the same checkpointing (fp32: split sums round differently).
    ref_out, ref_x_grad, ref_grads = step(ref, x)
    assert rel_err(out, ref_out) < 1e-5 and rel_err(x_grad, ref_x_grad) < 1e-5
    assert grads.keys() == ref_grads.keys() and all(rel_err(grads[k], ref_grads[k]) < 1e-5 for k in grads)
    # One all-reduce per block each way; a reentrant checkpoint recomputes the whole block, its all-reduce
    # included (the non-reentrant one stops after the last tensor backward needs, before it).
    assert dict(counted.backward) == {"all_reduce": LAYERS}
    assert counted.forward["all_reduce"] == (2 * LAYERS if reentrant else LAYERS)
    # ZeRO-3: one gather of everything per call, and one per recomputed norm
    assert counted.forward["all_gather"] == (1 + LAYERS if sharded else 0)


@contextmanager
def saved_bytes_per_device(model):
    """Bytes of the tensors each shard's graph keeps for backward (outside checkpointed blocks), per device."""
    counts = [0] * len(model.module_shards)
    handles = []
    for rank, shard in enumerate(model.module_shards):
        seen = set()

        def pack(t, rank=rank, seen=seen):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                counts[rank] += storage.nbytes()
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        handles.append(shard.register_forward_pre_hook(lambda *_, h=hooks: h.__enter__()))
        handles.append(shard.register_forward_hook(lambda *_, h=hooks: h.__exit__(None, None, None), always_call=True))
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_keeps_fewer_activations_on_every_device(reentrant, gen):
    ref = ResidualStack(DIM, HIDDEN, LAYERS)
    plain = split_copy(ref, 2, plan=PLAN)
    ref.reentrant = reentrant
    model = split_copy(ref, 2, plan=PLAN)
    x = torch.randn(4, 32, DIM, generator=gen, requires_grad=True)
    with saved_bytes_per_device(plain) as without:
        plain(x).sum().backward()
    with saved_bytes_per_device(model) as with_checkpointing:
        model(x).sum().backward()
    # Without: per block the norm's input and statistics, its output, the up projection's output (HIDDEN / 2
    # wide on each device) and the relu's. With: what the checkpoints keep (at most the blocks' inputs).
    block_input = x.numel() * 4
    assert all(w <= LAYERS * block_input for w in with_checkpointing)
    assert all(w * 4 < wo for w, wo in zip(with_checkpointing, without)), (with_checkpointing, without)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpoint_around_the_whole_split_model(reentrant, gen):
    ref = ResidualStack(DIM, HIDDEN, 2)
    model = split_copy(ref, 2, plan=PLAN)
    x = torch.randn(3, DIM, generator=gen, requires_grad=True)
    torch.utils.checkpoint.checkpoint(model, x, use_reentrant=reentrant).square().sum().backward()
    ref(x).square().sum().backward()
    grads = gathered_grads(model)
    assert all(rel_err(grads[k], p.grad) < 1e-5 for k, p in ref.named_parameters())
