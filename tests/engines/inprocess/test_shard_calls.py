"""The fast decode path's one interface to a model integration (engines/inprocess/shard_calls.py): `CompiledSteps`
with the default `ShardCalls` compiles and replays each shard of a plain split module with the eager split's numbers
and collectives, its arguments as given; an integration's own `ShardCalls` names the arguments, hands each shard its
own part of a per-device object and has the last word on the output. Dynamo's eager backend: the interface is what
is tested, not inductor."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import tensorshard as tp
from tensorshard.engines.inprocess.compiled_steps import CompiledSteps
from tensorshard.engines.inprocess.shard_calls import ShardCalls
from support.helpers import rel_err

pytestmark = pytest.mark.timeout(180)

_OPTIONS = {"backend": "eager", "fullgraph": True, "dynamic": False}


class Block(nn.Module):
    """An MLP whose forward takes a positional input and an optional keyword one."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x)))  # (B, 8): an all-reduce after the row-parallel `down`
        return y if shift is None else y + shift


def _split(ref: nn.Module) -> nn.Module:
    return tp.tensor_parallel(copy.deepcopy(ref), ["cpu", "cpu"], plan={"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()})


@pytest.fixture(scope="module")
def block() -> nn.Module:
    torch.manual_seed(0)
    return Block().eval()


def test_the_default_passes_everything_through():
    calls, x, out = ShardCalls(), torch.ones(2), object()
    assert calls.keywords((x,), {}) is None  # not named: the call runs as given, never stitched
    assert calls.own(x, 1) is x
    assert calls.back(out, {"x": x}) is out


def test_compiled_steps_with_the_default_calls_match_the_eager_split(block, gen):
    split = _split(block)
    steps = CompiledSteps(split, _OPTIONS)
    x, shift = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen)
    with torch.no_grad():
        with tp.count_collectives() as eager:
            expected = split(x, shift=shift)
        for _ in range(3):  # the first call compiles each shard, later ones replay
            with tp.count_collectives() as counted:
                got = steps(x, shift=shift)
            assert counted.counts == eager.counts == {"all_reduce": 1}
            assert rel_err(got, block(x, shift=shift)) < 1e-6  # fp32: the two halves summed in another order
            assert torch.equal(got, expected)  # the eager split's own sums: bit for bit
        assert rel_err(steps(x), block(x)) < 1e-6  # (another kind of call: compiled anew)
    assert steps.kinds


class PerDevice:
    """An argument the shards must each get their own part of (as a KV cache is, per device)."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts


class OwnParts(ShardCalls):
    """Names the positional input, hands each shard its own part, tags the output: records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def keywords(self, args: tuple, kwargs: dict) -> dict:
        return {"x": args[0], **kwargs} if args else dict(kwargs)

    def own(self, value, rank: int):
        with self.lock:
            self.asked.append(("own", rank))
        return value.parts[rank] if isinstance(value, PerDevice) else value

    def back(self, out, kwargs: dict):
        assert set(kwargs) == {"x", "shift"}  # the call's arguments as `keywords` named them
        with self.lock:
            self.asked.append(("back", -1))
        return {"y": out}


def test_an_integrations_calls_give_each_shard_its_own_part(block, gen):
    split = _split(block)
    calls = OwnParts()
    steps = CompiledSteps(split, _OPTIONS, calls=calls)
    x = torch.randn(3, 8, generator=gen)
    parts = [torch.full((3, 8), 1.0), torch.full((3, 8), 2.0)]
    with torch.no_grad():
        out = steps(x, shift=PerDevice(parts))
        # The output device's shard (rank 0) is the one returned; it added its own part.
        assert isinstance(out, dict) and rel_err(out["y"], block(x, shift=parts[0])) < 1e-6
        calls.asked.clear()
        steps(x, shift=PerDevice(parts))
    # Per call: each argument made each shard's own (2 arguments x 2 ranks), each shard's output handed back.
    assert sorted(calls.asked) == [("back", -1)] * 2 + [("own", 0)] * 2 + [("own", 1)] * 2


def test_calls_of_another_type_are_refused(block):
    with pytest.raises(TypeError, match="calls must be a ShardCalls"):
        CompiledSteps(_split(block), _OPTIONS, calls=lambda value, rank: value)


def test_the_split_model_says_whether_its_call_runs_on_this_thread(block, gen):
    """`running_here()` (what the fast path asks before it runs the shards itself): true inside a shard only."""
    split = _split(block)
    seen: list[bool] = []
    hooks = [shard.down.register_forward_hook(lambda *_: seen.append(split.running_here())) for shard in split.module_shards]
    with torch.no_grad():
        split(torch.randn(2, 8, generator=gen))
    for hook in hooks:
        hook.remove()
    assert seen == [True, True] and not split.running_here()
    assert split.shard_devices == [torch.device("cpu")] * 2
