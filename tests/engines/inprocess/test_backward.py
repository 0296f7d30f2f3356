"""The in-process backward pass: every shard runs its own, concurrently, and the caller sees one model.

What autograd promises for the unsplit model holds for the split one: gradients accumulate over several
backward() calls, retain_graph keeps the graph, autograd.grad leaves the parameters alone, hooks fire once
per parameter; a shard that fails or stalls in backward ends the call promptly, naming the device."""

import copy
import threading
import time

import pytest
import torch

import tensorshard as tp
from support import plans
from support.docs import docs_runs
from support.helpers import rel_err, split_copy
from support.hf_parity import gathered_grads
from support.models import FeedForward, TwoPairs

pytestmark = pytest.mark.timeout(60)



def pair(n=2, **kwargs):
    ref = TwoPairs()
    return ref, split_copy(ref, n, plan=plans.TWO_BLOCKS, **kwargs)


def grads_of(model) -> dict:
    """Every shard's gradients by (rank, name)."""
    return {(r, k): p.grad for r, s in enumerate(model.module_shards) for k, p in s.named_parameters()}


@pytest.mark.parametrize("n", [2, 3])
def test_shards_run_their_backward_passes_at_the_same_time_each_in_its_thread(n, gen):
    _, model = pair(n)
    # Every shard's hook waits for all the others': this passes only if the backward passes overlap.
    barrier = threading.Barrier(n, timeout=20)
    threads = {}

    def hook(rank):
        def record(grad):
            threads[rank] = threading.current_thread().name
            barrier.wait()

        return record

    for rank, shard in enumerate(model.module_shards):
        shard.b2.weight.register_hook(hook(rank))  # the first gradient of the backward pass, before any collective
    model(torch.randn(4, 8, generator=gen)).sum().backward()
    assert threads[0] == threading.current_thread().name  # the caller's thread runs shard 0
    assert sorted(threads[r] for r in range(1, n)) == [f"tensorshard-{r}" for r in range(1, n)]


def test_backward_costs_one_all_reduce_per_pair(gen):
    _, model = pair(3)
    x = torch.randn(4, 8, generator=gen, requires_grad=True)
    with tp.count_collectives() as counted:
        model(x).sum().backward()
    assert dict(counted.forward) == {"all_reduce": 2} and dict(counted.backward) == {"all_reduce": 2}


def test_hooks_fire_once_per_shard_parameter(gen):
    _, model = pair(2)
    fired = {}
    for rank, shard in enumerate(model.module_shards):
        for name, p in shard.named_parameters():
            p.register_hook(lambda g, key=(rank, name, "grad"): fired.__setitem__(key, fired.get(key, 0) + 1))
            p.register_post_accumulate_grad_hook(
                lambda t, key=(rank, name, "accumulated"): fired.__setitem__(key, fired.get(key, 0) + 1)
            )
    model(torch.randn(4, 8, generator=gen)).sum().backward()
    params = [(r, k) for r, s in enumerate(model.module_shards) for k, _ in s.named_parameters()]
    assert fired == {(r, k, kind): 1 for r, k in params for kind in ("grad", "accumulated")}


@pytest.mark.parametrize("n", [2, 3])
def test_gradients_accumulate_over_several_backward_calls(n, gen):
    ref, model = pair(n)
    xs = [torch.randn(4, 8, generator=gen) for _ in range(3)]
    for x in xs[:2]:  # two forward/backward pairs
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
    (model(xs[2]).sum() + model(xs[0]).sum()).backward()  # two forward calls, one backward
    (ref(xs[2]).sum() + ref(xs[0]).sum()).backward()
    mine = gathered_grads(model)
    assert mine.keys() == dict(ref.named_parameters()).keys()
    for name, p in ref.named_parameters():
        assert rel_err(mine[name], p.grad) < 1e-5, name
    norms = [s.norm.weight.grad for s in model.module_shards]
    assert all(torch.equal(g, norms[0]) for g in norms)  # replicated parameters: bit-identical on every device


def test_retain_graph_keeps_every_shards_graph(gen):
    _, model = pair(2)
    out = model(torch.randn(4, 8, generator=gen)).sum()
    out.backward(retain_graph=True)
    first = {k: g.clone() for k, g in grads_of(model).items()}
    out.backward()
    assert all(torch.allclose(g, 2 * first[k]) for k, g in grads_of(model).items())
    with pytest.raises(RuntimeError, match="a second time"):
        out.backward()


def test_autograd_grad_returns_input_gradients_and_leaves_the_parameters_alone(gen):
    ref, model = pair(3)
    x = torch.randn(4, 8, generator=gen, requires_grad=True)
    (mine,) = torch.autograd.grad(model(x).square().sum(), x)
    (theirs,) = torch.autograd.grad(ref(x).square().sum(), x)
    assert rel_err(mine, theirs) < 1e-5
    model(x).square().sum().backward(inputs=[x])
    assert rel_err(x.grad, theirs) < 1e-5
    assert all(g is None for g in grads_of(model).values())


def test_outputs_may_be_modified_in_place(gen):
    ref, model = pair(2)
    x = torch.randn(4, 8, generator=gen)
    loss = model(x).square().mean()
    loss *= 2  # transformers' Trainer scales the loss in place
    loss.backward()
    ref_loss = ref(x).square().mean()
    ref_loss *= 2
    ref_loss.backward()
    assert rel_err(model.module_shards[0].norm.weight.grad, ref.norm.weight.grad) < 1e-5


def test_no_grad_and_inference_mode_build_no_graph(gen):
    ref, model = pair(2)
    x = torch.randn(4, 8, generator=gen)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), tp.count_collectives() as counted:
            out = model(x)
        assert not out.requires_grad and rel_err(out, ref(x)) < 1e-5
        assert dict(counted.backward) == {}


def test_create_graph_is_refused(gen):
    _, model = pair(2)
    x = torch.randn(4, 8, generator=gen, requires_grad=True)
    with pytest.raises(NotImplementedError, match="create_graph=True"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_shard_raising_in_backward_fails_naming_the_device(rank, gen):
    ref, model = pair(2)

    def refuse(grad):
        raise ValueError("gradient hook refused")

    handle = model.module_shards[rank].a1.weight.register_hook(refuse)
    start = time.monotonic()
    with pytest.raises(ValueError, match="gradient hook refused") as info:
        model(torch.randn(4, 8, generator=gen)).sum().backward()
    assert time.monotonic() - start < 5
    assert f"cpu[{rank}] (rank {rank})" in " ".join(info.value.__notes__)
    handle.remove()
    model.zero_grad()
    x = torch.randn(4, 8, generator=gen)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert rel_err(model.module_shards[0].norm.weight.grad, ref.norm.weight.grad) < 1e-5


def test_a_shard_stalling_in_backward_times_out_naming_the_collective(gen):
    ref, model = pair(2, timeout=0.5)
    handle = model.module_shards[1].b2.weight.register_hook(lambda g: time.sleep(3))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"copy_to_parallel at a2 .*device cpu\[1\] \(rank 1\) did not arrive within 0.5 s"):
        model(torch.randn(4, 8, generator=gen)).sum().backward()
    assert time.monotonic() - start < 3
    handle.remove()
    time.sleep(3)  # the stalled shard comes back, accumulates b2's gradients, runs into its ended call and stops
    model.zero_grad()
    x = torch.randn(4, 8, generator=gen)
    model(x).sum().backward()
    ref(x).sum().backward()
    grads = gathered_grads(model)
    assert all(rel_err(grads[k], p.grad) < 1e-5 for k, p in ref.named_parameters())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_train(gen):
    # Each GPU's autograd thread runs its shard's backward nodes; the boundary runs the output device's shard.
    ref = FeedForward(8, 16)
    model = tp.tensor_parallel(copy.deepcopy(ref).cuda(), ["cuda:0", "cuda:1"], plan=plans.FEED_FORWARD, sharded=False)
    assert model._group.own_graphs
    x = torch.randn(4, 8, generator=gen)
    model(x.cuda()).sum().backward()
    ref(x).sum().backward()
    assert rel_err(gathered_grads(model)["w2.weight"], ref.w2.weight.grad) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_debug_mode_on_one_gpu_trains_without_deadlock(gen):
    # Debug mode puts every shard on the first GPU: their backward runs as one graph spanning the shards.
    ref = FeedForward(8, 16)
    model = tp.tensor_parallel(copy.deepcopy(ref), ["cuda:0", "cpu"], plan=plans.FEED_FORWARD, sharded=False, debug=True, timeout=20)
    assert not model._group.own_graphs
    x = torch.randn(4, 8, generator=gen)
    model(x.cuda()).sum().backward()
    ref(x).sum().backward()
    assert rel_err(gathered_grads(model)["w1.weight"], ref.w1.weight.grad) < 1e-5


@pytest.mark.timeout(450)  # the first test to ask runs every doc once (support.docs.docs_runs)
def test_docs_examples_run_with_the_results_they_state():
    """docs/inprocess.md's blocks, as tests/test_docs_snippets.py runs them, print what their comments state."""
    run = docs_runs()["docs/inprocess.md"]
    assert not run.errors, run.errors[0]
    printed = run.printed.splitlines()
    stated = ["[150, 151] (2, 7, 301)", "[(0, 'MainThread'), (1, 'tensorshard-1')]", "1 1", "PerDeviceOptimizer True",
              "per-tensor", "2 2 True", "4 3", "True", "3"]
    assert [line for line in stated if line not in printed] == []
    assert printed.index("4 3") < printed.index("True")
