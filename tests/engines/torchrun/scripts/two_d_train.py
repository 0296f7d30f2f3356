"""Data parallel across nodes x tensor parallel within a node, under torchrun: the README's multi-node
example, checked against one-process training of the same model and data.

    torchrun --nnodes=2 --nproc_per_node=2 --node_rank=N --master_addr=HOST --master_port=PORT two_d_train.py
"""

import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tensorshard as tp
from support import plans
from support.models import Transformer

if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    nodes = dist.get_world_size() // int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (nodes, int(os.environ["LOCAL_WORLD_SIZE"])), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(0)
    ref = Transformer(dim=64, n_heads=8, n_kv_heads=2, hidden=176)
    model = tp.parallelize(copy.deepcopy(ref), mesh["tensor_parallel"], plan=plans.transformer(8, 2))
    fully_shard(model, mesh=mesh["data_parallel"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    replica, per_replica = mesh["data_parallel"].get_local_rank(), 2
    gen = torch.Generator().manual_seed(5)
    worst = 0.0
    for step in range(3):
        tokens = torch.randint(0, 96, (nodes * per_replica, 9), generator=gen)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(tokens[replica * per_replica : (replica + 1) * per_replica]).square().mean()
        loss.backward()
        opt.step()
        ref_loss = ref(tokens).square().mean()
        ref_loss.backward()
        ref_opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # every rank's replica loss; TP ranks of a replica hold the same value
        mean = total.item() / dist.get_world_size()
        worst = max(worst, abs(mean - ref_loss.item()) / ref_loss.item())
        if dist.get_rank() == 0:
            print(f"step {step}: loss {mean:.6f} (one process: {ref_loss.item():.6f})")
    assert worst < 1e-5, worst
    if dist.get_rank() == 0:
        print(f"{nodes} nodes x {mesh['tensor_parallel'].size()} ranks: losses match one process (worst {worst:.1e})")
    dist.barrier()  # let every rank finish before the group goes away
    dist.destroy_process_group()
