"""transformers' gradient checkpointing on a split model, enabled before or after splitting: every shard
recomputes its decoder layers in its own backward pass; loss and gradients match the unsplit model with
the same checkpointing."""

import copy
import warnings

import pytest
import torch

import tensorshard as tp
from support.helpers import rel_err
from support.hf_parity import gathered_grads
from support.hf_configs import VOCAB, tiny_model

pytestmark = pytest.mark.timeout(120)


def enable(model, reentrant: bool = False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def counted_step(model, ids):
    with tp.count_collectives() as counted:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss, counted


@pytest.mark.parametrize("when", ["before", "after", "before, reentrant"])
@pytest.mark.parametrize("n", [2, 3])
def test_gradient_checkpointing_matches_the_unsplit_model(when, n, gen):
    ref = tiny_model("llama").train()
    plain = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n, sharded=False)
    unsplit = copy.deepcopy(ref)
    reentrant = when.endswith("reentrant")  # transformers 4's default
    if when.startswith("before"):  # the usual order: from_pretrained, gradient_checkpointing_enable(), split
        enable(ref, reentrant)
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * n, sharded=False)
    if when == "after":
        enable(model)
    enable(unsplit, reentrant)
    assert all(layer.gradient_checkpointing for shard in model.module_shards for layer in shard.model.layers)
    ids = torch.randint(1, VOCAB, (2, 10), generator=gen)
    loss, counted = counted_step(model, ids)
    ref_loss = unsplit(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert rel_err(loss, ref_loss) < 1e-5
    grads = gathered_grads(model)
    assert grads.keys() == {k for k, p in unsplit.named_parameters()}
    worst = max(rel_err(grads[k], p.grad) for k, p in unsplit.named_parameters())
    assert worst < 1e-5, worst
    # Without checkpointing the split model computes the same gradients, to the bit, with the same backward
    # collectives (2 per layer and the head's); checkpointing adds the recomputed layers' forward all-reduces.
    plain_loss, plain_counted = counted_step(plain, ids)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, grads[k]) for k, g in gathered_grads(plain).items())
    assert plain_counted.backward == counted.backward
    recomputed = counted.forward["all_reduce"] - plain_counted.forward["all_reduce"]
    assert 0 < recomputed <= 2 * ref.config.num_hidden_layers
