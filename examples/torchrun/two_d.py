"""2-D parallelism: FSDP2 over data-parallel replicas x tensorshard over tensor-parallel ranks.

    torchrun --nproc_per_node=4 examples/torchrun/two_d.py            # one machine: dp=2 x tp=2
    # several machines: data parallel across nodes, tensor parallel inside each node
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=$NODE_RANK --master_addr=$HEAD --master_port=29500 \
        examples/torchrun/two_d.py --tp 8
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import tensorshard as tp


class MLP(nn.Module):
    def __init__(self, dim=128, hidden=512):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (the rest is data parallel)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    mesh = init_device_mesh(
        device, (dist.get_world_size() // args.tp, args.tp), mesh_dim_names=("data_parallel", "tensor_parallel")
    )
    torch.manual_seed(0)
    model = nn.Sequential(*[MLP() for _ in range(4)])
    tp.parallelize(model, mesh["tensor_parallel"], plan={"*.gate": tp.ColwiseParallel(), "*.up": tp.ColwiseParallel(), "*.down": tp.RowwiseParallel()})
    for layer in model:
        fully_shard(layer, mesh=mesh["data_parallel"])  # ZeRO-3 over the data-parallel axis
    fully_shard(model, mesh=mesh["data_parallel"])

    data = TensorDataset(torch.randn(512, 16, 128, generator=torch.Generator().manual_seed(0)))
    sampler = tp.TensorParallelSampler(data, mesh)  # split over replicas, identical inside a TP group
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for (x,) in DataLoader(data, batch_size=8, sampler=sampler):
        loss = (model(x.to(device)) - 1).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if dist.get_rank() == 0:
        w = model[0].gate.weight
        print(f"mesh {tuple(mesh.shape)}: gate.weight {tuple(w.shape)} placements {w.placements}, "
              f"local {tuple(w.to_local().shape)}; last loss {loss.item():.4f}")
    dist.barrier()  # let every rank finish before the group goes away
    dist.destroy_process_group()
