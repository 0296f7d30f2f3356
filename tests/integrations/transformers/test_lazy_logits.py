"""lazy_logits: a model output whose logits are gathered on first read, by any way of reading them (unit test:
the gather is a plain function here; tests/engines/torchrun/test_torchrun_causal_lm_loss.py runs the real one)."""

import copy

import pytest
import torch
from torch.utils._pytree import tree_flatten

from tensorshard.integrations.lazy_logits import gather_logits_on_read

transformers = pytest.importorskip("transformers")
Output = transformers.modeling_outputs.CausalLMOutputWithPast

READS = {
    "attribute": lambda o: o.logits,
    "key": lambda o: o["logits"],
    "index": lambda o: o[1],
    "to_tuple": lambda o: o.to_tuple()[1],
    "items": lambda o: dict(o.items())["logits"],
    "values": lambda o: list(o.values())[1],
    "dict": lambda o: dict(o)["logits"],
    "pytree": lambda o: tree_flatten(o)[0][1],
    "copy": lambda o: copy.copy(o).logits,
}


@pytest.mark.parametrize("how", list(READS))
def test_first_read_gathers_once_then_the_output_is_plain(how):
    local = torch.randn(2, 3, 4, requires_grad=True)
    calls = []

    def gather(x):
        calls.append(torch.is_grad_enabled())
        return torch.cat([x, x * 2], dim=-1)  # stands in for the all-gather of two ranks' slices

    out = gather_logits_on_read(Output(loss=torch.tensor(1.0), logits=local), gather)
    assert isinstance(out, Output) and out.loss.item() == 1.0 and calls == []  # the loss alone: no gather
    assert "logits" in repr(out) and calls == []  # printing the output does not gather
    with torch.no_grad():  # gathered as in the forward: with autograd, since the slice needs a gradient
        got = READS[how](out)
    assert calls == [True] and got.shape == (2, 3, 8)
    assert type(out) is Output and out.logits is out["logits"]  # plain again; read twice, gathered once
    assert calls == [True]
    out.logits.sum().backward()
    assert torch.equal(local.grad, torch.full_like(local, 3.0))  # backward through the gathered logits


def test_a_failed_gather_never_leaves_the_slice_as_logits():
    def fail(x):
        raise RuntimeError("rank 1 stopped")

    out = gather_logits_on_read(Output(loss=torch.tensor(1.0), logits=torch.randn(2, 3, 4)), fail)
    with pytest.raises(RuntimeError, match="rank 1 stopped"):
        out.logits
    assert out.logits is None and out.loss.item() == 1.0
