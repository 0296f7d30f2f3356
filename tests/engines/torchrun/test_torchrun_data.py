"""Identical batches inside a tensor-parallel group: the sampler, broadcast_batch, and the check that fires
when ranks receive different inputs (instead of training silently on a mix of batches)."""


import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import tensorshard as tp
from support import plans
from support.harness import world_mesh
from support.models import FeedForward

pytestmark = pytest.mark.timeout(120)



def diverging_inputs_task() -> list[str]:
    torch.manual_seed(0)
    model = tp.parallelize(FeedForward(16, 32), world_mesh(), plan=plans.FEED_FORWARD)  # checks the first 3 calls
    rank = dist.get_rank()
    same = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    model(same)  # identical batches pass
    messages = []
    cases = [
        torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)),  # a different batch per rank
        same.flip(0) if rank == 1 else same,  # the same rows in another order: same sum, caught by position
    ]
    for batch in cases:
        with pytest.raises(tp.InputMismatchError) as info:
            model(batch)
        messages.append(str(info.value))
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)))  # after 3 calls: no more checks
    return messages


def test_diverging_batches_raise_on_every_rank_naming_the_input(pool2):
    for messages in pool2.run(diverging_inputs_task):
        for message in messages:
            assert "input 'x' of FeedForward differs between rank 0" in message and "rank 1" in message
            assert "TensorParallelSampler" in message and "check_inputs=0" in message


def compiled_inputs_task() -> list[str]:
    """torch.compile(model) in training (a Trainer with torch_compile=True): the traced forward holds the check
    as an operator (engines/torchrun/compiled_check.py), counted with the eager calls."""
    torch.manual_seed(0)
    model = tp.parallelize(FeedForward(16, 32), world_mesh(), plan=plans.FEED_FORWARD, check_inputs=3).train()
    step = torch.compile(model, backend="aot_eager")
    rank = dist.get_rank()
    same = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    model(same)  # one eager call checked: 2 left
    step(same).sum().backward()  # identical batches pass: 1 left
    messages = []
    with pytest.raises(tp.InputMismatchError) as info:
        step(x=same.flip(0) if rank == 1 else same)  # by keyword: the last check
    messages.append(str(info.value))
    step(torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))).sum().backward()  # no checks left
    messages.append(str(model.tensorshard.checks_left))
    return messages


def test_a_compiled_model_checks_its_first_training_calls(pool2):
    for mismatch, left in pool2.run(compiled_inputs_task):
        assert "input 'x' of FeedForward differs between rank 0" in mismatch and "TensorParallelSampler" in mismatch
        assert left == "0"


def keyword_inputs_task() -> str:
    from support import tiny_llama

    model = tp.parallelize(tiny_llama.build(), world_mesh(), plan=tiny_llama.plan())
    ids = torch.randint(0, tiny_llama.VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if dist.get_rank() == 1:
        mask[0, :3] = 0  # padding on one rank only
    with pytest.raises(tp.InputMismatchError) as info:
        model(input_ids=ids, attention_mask=mask)
    return str(info.value)


def test_check_names_keyword_inputs(pool2):
    assert all("input 'attention_mask' of LlamaForCausalLM" in m for m in pool2.run(keyword_inputs_task))


def sampler_task() -> tuple:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    data = list(range(20))
    from_2d = list(tp.TensorParallelSampler(data, mesh, seed=3))
    from_tp = list(tp.TensorParallelSampler(data, mesh["tensor_parallel"], seed=3))
    return mesh["data_parallel"].get_local_rank(), from_2d, from_tp


def test_sampler_gives_a_tp_group_the_same_indices(pool4):
    results = pool4.run(sampler_task)
    by_replica = {}
    for replica, from_2d, from_tp in results:
        assert from_2d == from_tp  # the 1-D TP mesh finds the same data-parallel coordinates
        by_replica.setdefault(replica, []).append(from_2d)
    assert sorted(by_replica) == [0, 1]
    for lists in by_replica.values():
        assert lists[0] == lists[1]  # both TP ranks of a replica
    assert sorted(by_replica[0][0] + by_replica[1][0]) == list(range(20))  # replicas split the data


def broadcast_task() -> list:
    rank = dist.get_rank()
    batch = {"ids": torch.full((2, rank + 3), rank), "labels": [torch.tensor([rank])], "name": f"rank{rank}"}
    got = tp.broadcast_batch(batch, world_mesh())
    return [got["ids"].tolist(), got["labels"][0].tolist(), got["name"]]


def test_broadcast_batch_shares_rank_zeros_batch(pool2):
    assert pool2.run(broadcast_task) == [[[[0, 0, 0], [0, 0, 0]], [0], "rank0"]] * 2
