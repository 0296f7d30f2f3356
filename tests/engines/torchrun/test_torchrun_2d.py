"""Composition with PyTorch's own distributed tools: FSDP2 on a data-parallel axis (2-D parallelism) and
torch.distributed.checkpoint (DCP) save/load at the same rank count, uneven and replicated layouts included."""

import copy
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tensorshard as tp
from support import plans
from support.harness import world_mesh
from support.helpers import rel_err
from support.models import FeedForward, Transformer

pytestmark = pytest.mark.timeout(120)


def two_d_task() -> list[tuple[float, float]]:
    """dp=2 x tp=2: each data-parallel replica gets half of a batch of 4 sequences; FSDP2 averages."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(0)
    ref = Transformer(dim=64, n_heads=8, n_kv_heads=2, hidden=176)
    model = tp.parallelize(copy.deepcopy(ref), mesh["tensor_parallel"], plan=plans.transformer(8, 2))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    dp_rank, dp_group = mesh["data_parallel"].get_local_rank(), mesh["data_parallel"].get_group()
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(5):
        tokens = torch.randint(0, 96, (4, 9), generator=gen)
        for o in (opt, ref_opt):
            o.zero_grad()
        loss = model(tokens[2 * dp_rank : 2 * dp_rank + 2]).square().mean()  # this replica's half
        loss.backward()
        opt.step()
        ref_loss = ref(tokens).square().mean()
        ref_loss.backward()
        ref_opt.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=dp_group)
        losses.append((total.item() / 2, ref_loss.item()))
    return losses


def test_fsdp2_data_parallel_times_tensor_parallel_matches_one_process(pool4):
    for losses in pool4.run(two_d_task):
        for split, single in losses:
            assert abs(split - single) <= 1e-5 * abs(single)  # fp32, 5 AdamW steps


def _build(kind: str, seed: int):
    torch.manual_seed(seed)
    mesh = world_mesh()
    if kind == "uneven":  # 90 over 4: 23/23/22/22, stored padded
        return tp.parallelize(FeedForward(64, 90), mesh, plan=plans.FEED_FORWARD), lambda g: torch.randn(3, 64, generator=g)
    # 2 KV heads over 4 ranks: each KV head stored on two ranks
    model = tp.parallelize(Transformer(dim=64, n_heads=8, n_kv_heads=2, hidden=176), mesh, plan=plans.transformer(8, 2))
    return model, lambda g: torch.randint(0, 96, (2, 9), generator=g)


def _train(model, opt, make_input, gen, steps):
    for _ in range(steps):
        opt.zero_grad()
        model(make_input(gen)).square().mean().backward()
        opt.step()


def checkpoint_task(kind: str, folder: str) -> float:
    """Train 2 steps, save model + optimizer with DCP, train 2 more; a fresh model loaded from the
    checkpoint and trained the same 2 steps must end bit-for-bit alike."""
    model, make_input = _build(kind, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, make_input, torch.Generator().manual_seed(1), 2)
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    after = torch.Generator().manual_seed(2)
    _train(model, opt, make_input, after, 2)
    probe = make_input(torch.Generator().manual_seed(3))
    expected = model(probe).detach()

    fresh, _ = _build(kind, seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    model_state, optim_state = get_state_dict(fresh, fresh_opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(fresh, fresh_opt, make_input, torch.Generator().manual_seed(2), 2)
    return rel_err(fresh(probe), expected)


@pytest.mark.parametrize("kind", ["uneven", "replicated_kv"])
def test_distributed_checkpoint_round_trip(pool4, tmp_path, kind):
    errors = pool4.run(checkpoint_task, kind, str(tmp_path / kind))
    assert max(errors) == 0.0
    assert any(name.endswith(".distcp") for name in os.listdir(tmp_path / kind))


def two_d_sequence_parallel_task() -> tuple:
    """dp=2 x tp=2 with FSDP2, sequence parallelism and the vocabulary-parallel loss on the tiny Llama."""
    import torch.nn.functional as F

    from support import tiny_llama

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    ref = tiny_llama.build()
    model = tp.parallelize(copy.deepcopy(ref), mesh["tensor_parallel"], plan=tiny_llama.sequence_parallel_plan())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    dp_rank, dp_group = mesh["data_parallel"].get_local_rank(), mesh["data_parallel"].get_group()
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, tiny_llama.VOCAB, (4, 8), generator=gen)
        mine = ids[2 * dp_rank : 2 * dp_rank + 2]
        for o in (opt, ref_opt):
            o.zero_grad()
        with tp.count_collectives() as counts:
            loss = tp.vocab_parallel_cross_entropy(model(mine).logits[:, :-1], mine[:, 1:])
            loss.backward()
        opt.step()
        ref_loss = F.cross_entropy(ref(ids).logits[:, :-1].reshape(-1, tiny_llama.VOCAB), ids[:, 1:].reshape(-1))
        ref_loss.backward()
        ref_opt.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=dp_group)
        losses.append((total.item() / 2, ref_loss.item()))
    return losses, dict(counts.backward)


def test_fsdp2_with_sequence_parallelism(pool4):
    losses, backward = pool4.run(two_d_sequence_parallel_task)[0]
    for split, single in losses:
        assert abs(split - single) <= 1e-5 * abs(single)
    # FSDP2 reads each module's gradients right after its backward: the 5 norm weights are reduced one
    # by one there (no end-of-backward bucket).
    assert backward["all_reduce"] == 5
