"""One module wrapped several times through tensorshard.compat, as code for the tensor_parallel package does (once per
config, to compare state dicts): the module stays as it was and usable, each split model holds its own copies (no
tensor shares storage with the module), and ``consume=True`` chooses tensorshard's behaviour (the weights move)."""

from __future__ import annotations

import itertools

import pytest
import torch

import tensorshard.compat as tp
from support.compat import MLP_RULES, Net, ids
from support.helpers import rel_err
from support.hf_configs import VOCAB, tiny_model

pytestmark = pytest.mark.timeout(120)


def _storages(module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in itertools.chain(module.parameters(), module.buffers())}


@pytest.mark.parametrize("world", [2, 3])
def test_one_module_wrapped_under_two_configs_gives_the_same_state_dict_and_stays_usable(world, gen):
    """The original's own test: the same module through a Config of Split objects, one of 1.x strings, and the
    default plan; the unsplit state dicts agree, and the module computes as before."""
    torch.manual_seed(0)
    module = Net()
    tensors = {n: t for n, t in itertools.chain(module.named_parameters(), module.named_buffers())}
    before = {n: t.detach().clone() for n, t in tensors.items()}
    x = ids(gen)
    want = module(x)

    objects = tp.Config(
        {r"mlp\.fc1\.(weight|bias)$": tp.state_actions.Split(world_size=world, dim=0),
         r"mlp\.fc2\.weight$": tp.state_actions.Split(world_size=world, dim=1),
         r"mlp\.fc2\.bias$": tp.state_actions.Scale(world_size=world)},
        {}, {r"mlp$": {0: "sum"}}, {},
    )
    strings = tp.Config(MLP_RULES, {}, {r"mlp$": {0: "sum"}}, {})
    models = [tp.TensorParallel(module, ["cpu"] * world, tensor_parallel_config=c) for c in (objects, strings, None)]

    for model in models:
        assert rel_err(model(x), want) < 1e-5
        assert not _storages(model) & _storages(module)  # its own copies
        with tp.save_tensor_parallel(model):
            state = model.state_dict()
        assert set(state) == set(before) and all(torch.equal(state[n], before[n]) for n in before)
    # The module: the very same tensors (no third copy), unchanged, and still callable.
    assert all(t is dict(itertools.chain(module.named_parameters(), module.named_buffers()))[n] for n, t in tensors.items())
    assert torch.equal(module(x), want)


@pytest.mark.parametrize("world", [2, 3])
def test_training_a_split_model_leaves_the_module_as_it_was(world, gen):
    ref = tiny_model("llama").train()
    model = tp.TensorParallelPreTrainedModel(ref, ["cpu"] * world, sharded=False)  # norms whole: shard 0 would take over their storage
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(1, VOCAB, (2, 6), generator=gen)
    for _ in range(3):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(p, before[n]) for n, p in ref.named_parameters())

    # The module now trains on its own, the same three steps: the two, trained apart, agree; a second split of
    # the module starts from its new weights.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        ref(input_ids=batch, labels=batch).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    again = tp.TensorParallelPreTrainedModel(ref, ["cpu"] * world)
    assert rel_err(again(input_ids=batch).logits, ref(input_ids=batch).logits) < 1e-5
    assert rel_err(model(input_ids=batch).logits, ref(input_ids=batch).logits) < 1e-4
    assert not all(torch.equal(p, before[n]) for n, p in ref.named_parameters())


def test_consume_true_moves_the_weights_as_tensorshard_does(gen):
    torch.manual_seed(0)
    module = Net()
    x = ids(gen)
    want = module(x)
    model = tp.tensor_parallel(module, ["cpu", "cpu"], consume=True)
    assert rel_err(model(x), want) < 1e-5
    assert all(p.is_meta for p in module.parameters())
    with pytest.raises(RuntimeError, match="was split over 2 device"):
        module(x)
    with pytest.raises(TypeError, match="was already split over 2 device"):
        tp.tensor_parallel(module, ["cpu", "cpu"])
    with pytest.raises(TypeError, match="consume must be True .* or False .*; got 'yes'"):
        tp.tensor_parallel(Net(), ["cpu", "cpu"], consume="yes")


def test_a_split_model_is_still_refused_before_anything_is_copied():
    model = tp.tensor_parallel(Net(), ["cpu", "cpu"])
    with pytest.raises(TypeError, match="is already split over 2 device"):
        tp.tensor_parallel(model, ["cpu", "cpu"])
    with pytest.raises(TypeError, match="is already split over 2 device"):
        tp.TensorParallel(model, ["cpu", "cpu", "cpu"])
