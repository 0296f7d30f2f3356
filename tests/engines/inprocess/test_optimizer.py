"""tp.per_device_optimizer: the wrapped optimizer's step, each shard's parameters in that shard's thread.

It promises the wrapped optimizer's results to the bit (the update of every torch.optim optimizer but LBFGS is
per parameter), with LR schedulers, gradient clipping, closures, state_dict round trips and sharded checkpoints
working as they do on the wrapped one, and its step hooks firing once per step."""

import copy
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import tensorshard as tp
from support import plans
from support.helpers import split_copy
from support.models import TwoPairs

pytestmark = pytest.mark.timeout(60)



def twins(n=2, sharded=False):
    """Two identical split models: one for the plain optimizer, one for the per-device one."""
    torch.manual_seed(0)
    first = split_copy(TwoPairs(), n, plan=plans.TWO_BLOCKS, sharded=sharded)
    return first, copy.deepcopy(first)


def params_of(model) -> list[torch.Tensor]:
    return [p for s in model.module_shards for p in s.parameters()]


def train(model, opt, gen, steps, *, scheduler=None):
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def assert_same(a, b):
    """Bit-identical parameters and optimizer state (the same elementwise arithmetic, parameter by parameter)."""
    pa, pb = params_of(a[0]), params_of(b[0])
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    for x, y in zip(pa, pb):
        sx, sy = a[1].state[x], b[1].state[y]
        assert sx.keys() == sy.keys()
        assert all(torch.equal(torch.as_tensor(sx[k]), torch.as_tensor(sy[k])) for k in sx)


OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
@pytest.mark.parametrize("n, sharded", [(2, False), (2, True), (3, True)])
def test_matches_the_wrapped_optimizer_bit_for_bit_with_an_lr_scheduler(make, n, sharded):
    plain_model, model = twins(n, sharded)
    plain = make(plain_model.parameters())
    opt = tp.per_device_optimizer(make(model.parameters()), model)
    assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt, tp.PerDeviceOptimizer)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (plain, opt)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        train(plain_model, plain, torch.Generator().manual_seed(1), 5, scheduler=schedules[0])
        train(model, opt, torch.Generator().manual_seed(1), 5, scheduler=schedules[1])
    assert opt.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == 1e-2 * 0.5**2
    assert_same((plain_model, plain), (model, opt))


def test_each_shard_steps_in_its_own_thread_at_the_same_time():
    n = 3
    _, model = twins(n)
    barrier = threading.Barrier(n, timeout=20)  # passes only if the shards' steps overlap
    seen = {}

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            (rank,) = {r for r, s in enumerate(model.module_shards) for p in s.parameters()
                       if any(p is q for g in self.param_groups for q in g["params"])}
            seen[rank] = threading.current_thread().name
            barrier.wait()
            return super().step(closure)

    opt = tp.per_device_optimizer(Recording(model.parameters(), lr=0.1), model)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert seen[0] == threading.current_thread().name  # the caller's thread runs shard 0
    assert [seen[r] for r in range(1, n)] == [f"tensorshard-{r}" for r in range(1, n)]


@pytest.mark.parametrize("clip", ["torch", "split"])
def test_gradient_clipping_over_the_split_parameters(clip):
    plain_model, model = twins(2, sharded=True)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    opt = tp.per_device_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    clipped = []

    def clip_by(m):
        norm = m.clip_grad_norm_(0.05) if clip == "split" else torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        clipped.append(norm > 0.05)

    for m, o in ((plain_model, plain), (model, opt)):
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            m(torch.randn(4, 8, generator=gen)).square().mean().backward()
            clip_by(m)
            o.step()
            o.zero_grad()
    assert all(clipped)  # the clipping mattered
    assert_same((plain_model, plain), (model, opt))


def test_state_dict_round_trip_and_the_same_format_as_the_wrapped_optimizer():
    plain_model, model = twins(2)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    opt = tp.per_device_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    train(plain_model, plain, torch.Generator().manual_seed(3), 2)
    train(model, opt, torch.Generator().manual_seed(3), 2)
    saved = opt.state_dict()
    assert saved["param_groups"] == plain.state_dict()["param_groups"]
    assert saved["state"].keys() == plain.state_dict()["state"].keys()

    resumed_model = copy.deepcopy(model)  # the weights, without the optimizer
    resumed = tp.per_device_optimizer(torch.optim.AdamW(resumed_model.parameters(), lr=0.5), resumed_model)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["lr"] == 1e-2
    train(plain_model, plain, torch.Generator().manual_seed(4), 2)
    train(resumed_model, resumed, torch.Generator().manual_seed(4), 2)
    assert_same((plain_model, plain), (resumed_model, resumed))


def test_sharded_checkpoints_save_and_load_its_state(tmp_path):
    _, model = twins(2, sharded=True)
    opt = tp.per_device_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    train(model, opt, torch.Generator().manual_seed(5), 2)
    tp.save_sharded(model, tmp_path, optimizer=opt)
    again = copy.deepcopy(model)
    again_opt = tp.per_device_optimizer(torch.optim.AdamW(again.parameters(), lr=0.5), again)
    tp.load_sharded(again, tmp_path, optimizer=again_opt, progress=False)
    assert again_opt.param_groups[0]["lr"] == 1e-2
    assert_same((model, opt), (again, again_opt))


def test_step_hooks_fire_once_per_step_wherever_registered():
    _, model = twins(2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = tp.per_device_optimizer(inner, model)
    fired = []
    inner.register_step_pre_hook(lambda o, a, k: fired.append(("inner pre", o)))
    opt.register_step_post_hook(lambda o, a, k: fired.append(("outer post", o)))
    handle = register_optimizer_step_post_hook(lambda o, a, k: fired.append(("global post", o)))
    try:
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    finally:
        handle.remove()
    assert fired == [("inner pre", opt), ("outer post", opt), ("global post", opt)] * 2


def test_a_closure_runs_once_in_the_callers_thread_and_its_loss_is_returned():
    plain_model, model = twins(2)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)
    opt = tp.per_device_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(6))
    calls = []

    def closure_for(m, o):
        def closure():
            calls.append(threading.current_thread().name)
            o.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            return loss

        return closure

    for _ in range(2):
        theirs = plain.step(closure_for(plain_model, plain))
        mine = opt.step(closure_for(model, opt))
        assert torch.equal(mine, theirs)
    assert calls == [threading.current_thread().name] * 4
    assert_same((plain_model, plain), (model, opt))


def test_parameters_outside_the_split_model_step_in_the_callers_thread():
    plain_model, model = twins(2)
    extra = [nn.Parameter(torch.ones(3)) for _ in range(2)]
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    opt = tp.per_device_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    plain.add_param_group({"params": [extra[0]], "lr": 0.1})
    opt.add_param_group({"params": [extra[1]], "lr": 0.1})
    for m, o, e in ((plain_model, plain, extra[0]), (model, opt, extra[1])):
        (m(torch.ones(4, 8)).sum() + e.sum()).backward()
        o.step()
    assert torch.equal(extra[0], extra[1]) and not torch.equal(extra[1], torch.ones(3))
    assert_same((plain_model, plain), (model, opt))


def test_a_shard_that_fails_in_step_names_its_device_and_the_model_stays_usable():
    _, model = twins(2)
    bad = model.module_shards[1].a1.weight
    failing = [True]

    class FailsOnRankOne(torch.optim.SGD):
        def step(self, closure=None):
            if failing[0] and any(p is bad for g in self.param_groups for p in g["params"]):
                raise ValueError("out of memory, say")
            return super().step(closure)

    opt = tp.per_device_optimizer(FailsOnRankOne(model.parameters(), lr=0.1), model)
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(ValueError, match="out of memory") as error:
        opt.step()
    assert any("cpu[1] (rank 1)" in note for note in error.value.__notes__)
    failing[0] = False
    before = bad.clone()
    opt.step()  # the next step runs
    assert not torch.equal(bad, before)


def test_a_step_inside_a_shards_backward_runs_there():
    """Optimizer in backward: one optimizer per parameter, stepped by its gradient hook in that shard's thread."""
    plain_model, model = twins(2)
    per_param = {}

    def step_now(p):
        per_param[p].step()
        per_param[p].zero_grad()

    for m, wrap in ((plain_model, False), (model, True)):
        for p in params_of(m):
            opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
            per_param[p] = tp.per_device_optimizer(opt, model) if wrap else opt
            p.register_post_accumulate_grad_hook(step_now)
    for m in (plain_model, model):
        for seed in (7, 8):
            m(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))).square().mean().backward()
    assert all(torch.equal(a, b) for a, b in zip(params_of(plain_model), params_of(model)))


def test_bad_arguments_are_refused_clearly():
    _, model = twins(2)
    with pytest.raises(TypeError, match="LBFGS cannot step per device"):
        tp.per_device_optimizer(torch.optim.LBFGS(model.parameters()), model)
    with pytest.raises(TypeError, match="takes a torch.optim.Optimizer"):
        tp.per_device_optimizer(model.parameters(), model)
    with pytest.raises(TypeError, match="model must be the split model"):
        tp.per_device_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), [model])
    opt = tp.per_device_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    assert tp.per_device_optimizer(opt, model) is opt  # wrapping twice changes nothing
    with pytest.raises(TypeError, match="cannot be pickled"):
        copy.deepcopy(opt)


def test_without_a_split_model_the_optimizer_is_returned_as_it_is():
    plain = TwoPairs()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    assert tp.per_device_optimizer(opt, plain) is opt
