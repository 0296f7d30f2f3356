"""ZeRO-3 for what the plan leaves whole: 1/N of the replicated parameters and of their optimizer state per
device, one all-gather per forward call, the same training losses."""

import copy

import pytest
import torch

import tensorshard as tp
from support import plans
from support.helpers import rel_err
from support.models import Transformer

pytestmark = pytest.mark.timeout(60)


def replicated_names(model) -> list[str]:
    return [n for n, split in model.splits.items() if split is None and n.endswith(("weight", "bias"))]


def per_device_bytes(model, opt=None) -> list[tuple[int, int]]:
    """(bytes of the plan's replicated parameters, bytes of their AdamW state) on each device."""
    names = set(replicated_names(model))
    out = []
    for shard in model.module_shards:
        params = [p for n, p in shard.named_parameters() if n in names]
        state = sum(v.numel() * v.element_size() for p in params for v in (opt.state[p].values() if opt else []) if v.dim() > 0)
        out.append((sum(p.numel() * p.element_size() for p in params), state))
    return out


def run(ref, sharded: bool, steps: int = 4):
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plans.transformer(8, 2), sharded=sharded)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(steps):
        loss = model(torch.randint(0, 96, (2, 7), generator=gen)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return model, opt, losses


def test_sharded_halves_replicated_parameters_and_their_adamw_state_with_equal_losses():
    torch.manual_seed(0)
    ref = Transformer(n_heads=8, n_kv_heads=2, bias=True)  # norms and row-parallel biases stay whole
    whole, whole_opt, whole_losses = run(ref, sharded=False)
    zero, zero_opt, zero_losses = run(ref, sharded=True)
    # Every replicated tensor here has an even length, so "half" is exact.
    for (p_whole, s_whole), (p_zero, s_zero) in zip(per_device_bytes(whole, whole_opt), per_device_bytes(zero, zero_opt)):
        assert p_zero * 2 == p_whole and s_zero * 2 == s_whole
        assert s_whole == 2 * p_whole  # exp_avg + exp_avg_sq
    split_bytes = tp.memory_per_device(whole)["cpu[0]"] - per_device_bytes(whole)[0][0]
    assert tp.memory_per_device(zero)["cpu[0]"] == split_bytes + per_device_bytes(whole)[0][0] // 2
    # Rows are updated elementwise exactly as the full copies were: the same losses, to the bit.
    assert all(torch.equal(a, b) for a, b in zip(whole_losses, zero_losses))
    with tp.save_tensor_parallel(whole), tp.save_tensor_parallel(zero):
        a, b = whole.state_dict(), zero.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_one_all_gather_per_forward_and_nothing_more_in_backward(gen):
    ref = Transformer(n_heads=8, n_kv_heads=2, bias=True)
    plain = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plans.transformer(8, 2), sharded=False)
    zero = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plans.transformer(8, 2), sharded=True)
    tokens = torch.randint(0, 96, (2, 7), generator=gen)
    counts = []
    for model in (plain, zero):
        with tp.count_collectives() as fwd:
            y = model(tokens)
        with tp.count_collectives() as bwd:
            y.square().mean().backward()
        counts.append((fwd, bwd))
    (pf, pb), (zf, zb) = counts
    assert zf.forward["all_gather"] == pf.forward["all_gather"] + 1  # all partitioned parameters at once
    assert [w for _, kind, _, w in zf.log if kind == "all_gather"].count("zero-3") == 1
    replicated = sum(p.numel() * 4 for n, p in ref.named_parameters() if plain.splits[n] is None)
    assert zf.forward_bytes - pf.forward_bytes == replicated  # each device receives the full tensors
    assert zb.counts == pb.counts  # backward keeps each device's rows: no communication
    assert rel_err(zero(tokens), ref(tokens)) < 1e-5
    grads = [p.grad for p in zero.module_shards[0].parameters() if p.grad is not None]
    assert all(g.shape == p.shape for g, p in zip(grads, zero.module_shards[0].parameters()))


def test_default_is_on_for_training_and_off_for_inference():
    model = Transformer(n_heads=8, n_kv_heads=2)
    assert getattr(tp.tensor_parallel(copy.deepcopy(model), ["cpu"] * 2, plan=plans.transformer(8, 2)), "zero_splits", {})
    assert not getattr(tp.tensor_parallel(copy.deepcopy(model).eval(), ["cpu"] * 2, plan=plans.transformer(8, 2)), "zero_splits", {})
    assert not getattr(tp.tensor_parallel(copy.deepcopy(model), ["cpu"], plan=plans.transformer(8, 2)), "zero_splits", {})
    frozen = copy.deepcopy(model).requires_grad_(False)
    assert not getattr(tp.tensor_parallel(frozen, ["cpu"] * 2, plan=plans.transformer(8, 2)), "zero_splits", {})


def test_sharded_param_names_choose_and_are_checked(gen):
    ref = Transformer(n_heads=8, n_kv_heads=2)
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 3, plan=plans.transformer(8, 2), sharded_param_names=["norm.weight"])
    assert list(model.zero_splits) == ["norm.weight"]
    assert [model.module_shards[r].norm.weight.shape[0] for r in range(3)] == [22, 21, 21]  # 64 rows over 3
    tokens = torch.randint(0, 96, (2, 5), generator=gen)
    assert rel_err(model(tokens), ref(tokens)) < 1e-5

    def wrap(names, **kw):
        return tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plans.transformer(8, 2), sharded_param_names=names, **kw)

    with pytest.raises(ValueError, match="'norm.wieght' is not a parameter of the model. Closest: norm.weight"):
        wrap(["norm.wieght"])
    with pytest.raises(ValueError, match="already split by the plan"):
        wrap(["layers.0.attn.wq.weight"])
    with pytest.raises(ValueError, match="sharded=False turns it off"):
        wrap(["norm.weight"], sharded=False)
    with pytest.raises(TypeError, match="list of parameter names"):
        wrap("norm.weight")


def test_a_failing_shard_restores_the_slices(gen):
    ref = Transformer(n_heads=8, n_kv_heads=2)
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cpu"] * 2, plan=plans.transformer(8, 2), sharded=True)
    with pytest.raises(RuntimeError):
        model(torch.zeros(1, 3))  # float ids: the embedding lookup fails on every device
    assert model.module_shards[1].norm.weight.shape == (32,)  # back to the device's rows
    tokens = torch.randint(0, 96, (2, 5), generator=gen)
    assert rel_err(model(tokens), ref(tokens)) < 1e-5
