"""A plain torch.optim optimizer over a model split on CPU slots steps each device's parameters in its shard's
thread (engines/inprocess/default_step.py), with the serial step's results to the bit; where that cannot be
guaranteed (a closure, step hooks of the optimizer's own, a subclass's own step) the serial step runs."""

import copy
import sys
import threading

import pytest
import torch
from torch import nn

from support import plans
from support.helpers import split_copy
from support.models import TwoPairs

pytestmark = pytest.mark.timeout(60)

MAIN = threading.current_thread().name
ADAM, SGD = sys.modules[torch.optim.Adam.__module__], sys.modules[torch.optim.SGD.__module__]  # their update functions


@pytest.fixture
def threads(monkeypatch):
    """The names of the threads that ran Adam's and SGD's update, one entry per call that updated parameters."""
    seen: list[str] = []
    for module, name in ((ADAM, "adam"), (SGD, "sgd")):
        update = getattr(module, name)

        def recording(params, *args, _update=update, **kwargs):
            if params:
                seen.append(threading.current_thread().name)
            return _update(params, *args, **kwargs)

        monkeypatch.setattr(module, name, recording)
    return seen


def twins(n, sharded):
    torch.manual_seed(0)
    first = split_copy(TwoPairs(), n, plan=plans.TWO_BLOCKS, sharded=sharded)
    return first, copy.deepcopy(first)


def serial(opt):
    """The same optimizer, forced onto the caller's thread: a step hook of its own turns the default off."""
    opt.register_step_pre_hook(lambda *_: None)
    return opt


def params_of(model):
    return [p for s in model.module_shards for p in s.parameters()]


def train(model, opt, steps=3, **step):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        opt.step(**step)
        opt.zero_grad()


def assert_same(a, b, opt_a, opt_b):
    for x, y in zip(params_of(a), params_of(b)):
        assert torch.equal(x, y)
        assert opt_a.state[x].keys() == opt_b.state[y].keys()
        assert all(torch.equal(torch.as_tensor(opt_a.state[x][k]), torch.as_tensor(opt_b.state[y][k])) for k in opt_a.state[x])


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
@pytest.mark.parametrize("n, sharded", [(2, False), (3, True)])
def test_a_plain_optimizer_steps_every_shard_in_its_thread_with_the_serial_results(make, n, sharded, threads):
    model, reference = twins(n, sharded)
    runs = []
    for m, opt in ((reference, serial(make(reference.parameters()))), (model, make(model.parameters()))):
        threads.clear()
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for _ in range(3):
            train(m, opt, steps=1)
            scheduler.step()
        runs.append((opt, list(threads)))
    (ref_opt, ref_threads), (opt, per_shard) = runs
    assert ref_threads == [MAIN] * 3  # the reference stepped in the caller's thread; the default, once per shard
    assert sorted(per_shard) == sorted([MAIN] * 3 + [f"tensorshard-{r}" for r in range(1, n) for _ in range(3)])
    assert_same(model, reference, opt, ref_opt)
    assert not torch.equal(params_of(model)[0], params_of(twins(n, sharded)[0])[0])  # it trained


def test_gradients_stay_readable_after_the_step_and_outside_parameters_step_too(threads):
    model, reference = twins(2, False)
    extra, ref_extra = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([*model.parameters(), extra], lr=1e-2)
    ref_opt = serial(torch.optim.AdamW([*reference.parameters(), ref_extra], lr=1e-2))
    for m, o, e in ((model, opt, extra), (reference, ref_opt, ref_extra)):
        (m(torch.ones(4, 8)).sum() + e.sum()).backward()
        grads = [p.grad.clone() for p in params_of(m)]
        o.step()
        assert all(p.grad is not None and torch.equal(p.grad, g) for p, g in zip(params_of(m), grads))
    assert torch.equal(extra, ref_extra) and not torch.equal(extra, torch.ones(3))
    assert_same(model, reference, opt, ref_opt)


def test_a_closure_or_a_subclass_step_keeps_the_serial_step(threads):
    model, _ = twins(2, False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def closure():
        opt.zero_grad()
        loss = model(torch.ones(4, 8)).sum()
        loss.backward()
        return loss

    opt.step(closure)
    assert set(threads) == {MAIN}

    class Counting(torch.optim.SGD):
        calls = 0

        def step(self, closure=None):
            Counting.calls += 1  # would count once per device if stepped per shard
            return super().step(closure)

    threads.clear()
    counting = Counting(model.parameters(), lr=0.1)
    model(torch.ones(4, 8)).sum().backward()
    counting.step()
    assert Counting.calls == 1 and set(threads) == {MAIN}


def test_step_hooks_of_the_optimizer_fire_once_around_a_serial_step(threads):
    model, _ = twins(2, False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fired = []
    opt.register_step_pre_hook(lambda o, a, k: fired.append(("pre", all(p.grad is not None for p in params_of(model)))))
    opt.register_step_post_hook(lambda o, a, k: fired.append(("post", all(p.grad is not None for p in params_of(model)))))
    model(torch.ones(4, 8)).sum().backward()
    opt.step()
    assert fired == [("pre", True), ("post", True)] and set(threads) == {MAIN}


def test_a_shard_whose_step_fails_names_its_device_and_the_next_step_runs(monkeypatch):
    model, _ = twins(2, False)
    bad = model.module_shards[1].a1.weight
    update, failing = SGD.sgd, [True]

    def sgd(params, *args, **kwargs):
        if failing[0] and any(p is bad for p in params):
            raise ValueError("out of memory, say")
        return update(params, *args, **kwargs)

    monkeypatch.setattr(SGD, "sgd", sgd)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(ValueError, match="out of memory") as error:
        opt.step()
    assert any("cpu[1] (rank 1)" in note for note in error.value.__notes__)
    failing[0] = False
    before = bad.clone()
    opt.step()
    assert not torch.equal(bad, before)


def test_the_shard_timeline_sees_every_call_and_each_shards_waits():
    import tensorshard as tp

    model, _ = twins(2, False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tp.shard_timeline() as timeline:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    summary = timeline.summary()
    assert summary["calls"] == 3  # the forward call, the backward pass, the optimizer step
    assert len(summary["busy"]) == 2 and all(b > 0 for b in summary["busy"])
    assert 0 <= summary["one_running"] <= summary["wall"]
    assert len(timeline.waits) > 0  # a shard waited at a collective at least once
    with tp.shard_timeline() as idle:
        pass
    assert idle.summary()["calls"] == 0
