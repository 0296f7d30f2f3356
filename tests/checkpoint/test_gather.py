"""Gathered saves write the unsplit model's keys and shapes; a plain model loads them back exactly."""

import copy

import pytest
import torch

import tensorshard as tp
from support import plans
from support.helpers import rel_err
from support.models import Transformer

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("n", [2, 3])
def test_save_tensor_parallel_round_trips_into_a_plain_model(n, gen, tmp_path):
    ref = Transformer(n_heads=8, n_kv_heads=2)  # n=3: replicated KV heads, taken from their first holder
    expected = copy.deepcopy(ref.state_dict())
    model = tp.tensor_parallel(ref, ["cpu"] * n, plan=plans.transformer(8, 2))
    with tp.save_tensor_parallel(model):
        state = model.state_dict()
    assert list(state) == list(expected)
    for key in expected:
        assert torch.equal(state[key], expected[key]), key
    torch.save(state, tmp_path / "model.pt")
    plain = Transformer(n_heads=8, n_kv_heads=2)
    plain.load_state_dict(torch.load(tmp_path / "model.pt"))
    tokens = torch.randint(0, 96, (2, 5), generator=gen)
    assert rel_err(plain(tokens), model(tokens)) < 1e-5
    assert "module_shards.0.output.weight" in model.state_dict()  # outside the context: the shards


def test_gathered_state_dict_needs_a_split_model():
    with pytest.raises(TypeError, match="TensorParallel"):
        next(tp.gathered_state_dict(Transformer()))
