"""The minimum of communication under torchrun: 2 all-reduces forward and 2 backward per transformer block,
counted by our counter and by torch's CommDebugMode (which sees each of ours as the functional collective of
its kind, whether shared memory or gloo carries it)."""

import copy
import os

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import tensorshard as tp
from support import plans, tiny_llama
from support.harness import world_mesh
from support.helpers import rel_err
from support.models import Block, FeedForward

pytestmark = pytest.mark.timeout(120)

BLOCK_PLAN = {k.removeprefix("layers.*."): v for k, v in plans.transformer(8, 4).items() if k.startswith("layers")}



def counted(model, x, loss=lambda y: y.square().mean()):
    """(ours forward, ours backward, CommDebugMode forward total, CommDebugMode backward total)."""
    with tp.count_collectives() as fwd, CommDebugMode() as torch_fwd:
        y = model(x)
    with tp.count_collectives() as bwd, CommDebugMode() as torch_bwd:
        loss(y).backward()
    return fwd, bwd, torch_fwd.get_total_counts(), torch_bwd.get_total_counts()


def block_task(heads: int, kv_heads: int) -> tuple:
    torch.manual_seed(0)
    ref = Block(64, heads, kv_heads, 176)
    plan = {k.removeprefix("layers.*."): v for k, v in plans.transformer(heads, kv_heads).items() if k.startswith("layers")}
    model = tp.parallelize(copy.deepcopy(ref), world_mesh(), plan=plan, check_inputs=0)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    fwd, bwd, torch_fwd, torch_bwd = counted(model, x)
    xr = x.detach().clone().requires_grad_()
    ref(xr).square().mean().backward()
    assert rel_err(x.grad, xr.grad) < 1e-5  # the input gradient is the unsplit model's, not N times it
    return fwd.counts, bwd.counts, fwd.bytes, bwd.bytes, torch_fwd, torch_bwd


def test_transformer_block_costs_two_all_reduces_each_way(pool2):
    fwd, bwd, fwd_bytes, bwd_bytes, torch_fwd, torch_bwd = pool2.run(block_task, 8, 4)[0]
    assert fwd == {"all_reduce": 2} and bwd == {"all_reduce": 2}
    assert fwd_bytes == bwd_bytes == 2 * (2 * 9 * 64 * 4)  # two (2, 9, 64) fp32 activations each way
    assert (torch_fwd, torch_bwd) == (2, 2)  # nothing else goes over the wire


def test_replicated_kv_heads_add_one_reduction_per_weight(pool4):
    # 2 KV heads on 4 ranks: each k/v weight is held by two ranks, whose gradients are summed (tie).
    fwd, bwd, *_, torch_fwd, torch_bwd = pool4.run(block_task, 8, 2)[0]
    assert fwd == {"all_reduce": 2} and bwd == {"all_reduce": 2 + 2}
    assert (torch_fwd, torch_bwd) == (2, 4)


def feed_forward_task(hidden: int) -> tuple:
    """Ours against the tutorial DTensor plan for the same FeedForward (which cannot split 90 over 4:
    "a and b must have same reduction dim", pytorch issue 150336)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    ref = FeedForward(64, hidden)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ours = counted(tp.parallelize(copy.deepcopy(ref), world_mesh(), plan=plans.FEED_FORWARD, check_inputs=0), x)
    if hidden % torch.distributed.get_world_size():
        return ours[0].counts, ours[1].counts, ours[2], ours[3], None, None
    dtensor = parallelize_module(
        copy.deepcopy(ref), world_mesh(), {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
    )
    theirs = counted(dtensor, x.detach().clone().requires_grad_())
    return ours[0].counts, ours[1].counts, ours[2], ours[3], theirs[2], theirs[3]


@pytest.mark.parametrize("hidden", [176, 90])  # 90 over 4: 23/23/22/22, stored padded
def test_feed_forward_one_all_reduce_each_way(pool4, hidden):
    fwd, bwd, torch_fwd, torch_bwd, dtensor_fwd, dtensor_bwd = pool4.run(feed_forward_task, hidden)[0]
    assert fwd == {"all_reduce": 1} and bwd == {"all_reduce": 1} and (torch_fwd, torch_bwd) == (1, 1)
    if hidden == 176:
        assert (dtensor_fwd, dtensor_bwd) == (1, 2)  # the DTensor plan reduces w1's and w3's input gradients apart


def llama_task() -> tuple:
    ref = tiny_llama.build()
    model = tp.parallelize(copy.deepcopy(ref), world_mesh(), plan=tiny_llama.plan())
    ids = torch.randint(0, tiny_llama.VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    fwd, bwd, torch_fwd, torch_bwd = counted(model, ids, loss=lambda out: out.logits.square().mean())
    return fwd.counts, bwd.counts, torch_bwd


def test_llama_adds_only_embedding_and_head(pool2):
    fwd, bwd, torch_bwd = pool2.run(llama_task)[0]
    # forward: vocab-parallel embedding + 2 per layer; the head's logits are gathered once
    assert fwd == {"all_reduce": 1 + 2 * 2, "all_gather": 1}
    # backward: 2 per layer + the head's input
    assert bwd == {"all_reduce": 2 * 2 + 1} and torch_bwd == 5


def distributed_flag_task() -> float:
    """tensor_parallel(..., distributed=True) takes the mesh from the environment (here: the pool's group)."""
    torch.manual_seed(0)
    ref = FeedForward(32, 48)
    model = tp.tensor_parallel(copy.deepcopy(ref), plan=plans.FEED_FORWARD, distributed=True)
    assert model.tensorshard.mesh.size() == torch.distributed.get_world_size()
    assert model.w1.weight.to_local().shape == (48 // torch.distributed.get_world_size(), 32)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    return rel_err(model(x), ref(x))


def test_tensor_parallel_distributed_flag(pool2):
    assert max(pool2.run(distributed_flag_task)) < 1e-5


def comm_debug_mode_task(shared: bool) -> dict:
    """CommDebugMode around a split Block (forward, backward) and a tiny Llama's forward, on a fresh group whose
    collectives go through shared memory or gloo."""
    from torch.distributed.device_mesh import DeviceMesh

    world = torch.distributed.get_world_size()
    os.environ["TENSORSHARD_SHM"] = "1" if shared else "0"
    try:
        mesh = DeviceMesh.from_group(torch.distributed.new_group(list(range(world))), "cpu")
        torch.manual_seed(0)
        block = tp.parallelize(Block(64, 8, 4, 176), mesh, plan=BLOCK_PLAN, check_inputs=0)
        llama = tp.parallelize(tiny_llama.build(), mesh, plan=tiny_llama.plan(), check_inputs=0)
    finally:
        del os.environ["TENSORSHARD_SHM"]
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1))
    with CommDebugMode() as fwd:
        y = block(x)
    with CommDebugMode() as bwd:
        y.square().mean().backward()
    with CommDebugMode() as logits, tp.count_collectives() as ours:
        llama(torch.randint(0, tiny_llama.VOCAB, (2, 8), generator=torch.Generator().manual_seed(2)))

    def named(counts) -> dict:
        return {str(op): n for op, n in counts.items() if n}

    return {
        "shared": block.tensorshard.comm.guard.shm is not None,
        "forward": named(fwd.get_comm_counts()), "backward": named(bwd.get_comm_counts()),
        "modules": {m: named(c["forward"]) for m, c in fwd.comm_module_counts.items() if m.startswith("Block.") and c["forward"]},
        "llama": named(logits.get_comm_counts()), "ours": ours.counts,
    }


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "gloo"])
def test_comm_debug_mode_sees_them_as_functional_collectives(pool2, shared):
    out = pool2.run(comm_debug_mode_task, shared)[0]
    assert out["shared"] == shared
    # the keys of DTensor's own collectives (torch.ops.c10d_functional.*), per module as well
    assert out["forward"] == out["backward"] == {"c10d_functional.all_reduce": 2}
    assert out["modules"] == {"Block.attn": {"c10d_functional.all_reduce": 1}, "Block.attn.wo": {"c10d_functional.all_reduce": 1},
                              "Block.ffn": {"c10d_functional.all_reduce": 1}, "Block.ffn.w2": {"c10d_functional.all_reduce": 1}}
    assert out["llama"] == {"c10d_functional.all_reduce": out["ours"]["all_reduce"],
                            "c10d_functional.all_gather_into_tensor": out["ours"]["all_gather"]}
