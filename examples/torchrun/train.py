"""Tensor-parallel training under torchrun: every rank holds its shards, all ranks see the same batches.

    torchrun --nproc_per_node=2 examples/torchrun/train.py          # CPU: gloo; GPUs: NCCL
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, TensorDataset

import tensorshard as tp


class Block(nn.Module):
    def __init__(self, dim: int = 128, hidden: int = 352) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    device = "cuda" if cuda else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("tensor_parallel",))

    model = nn.Sequential(Block(), Block())
    plan = tp.Plan({"*.up": tp.ColwiseParallel(), "*.down": tp.RowwiseParallel()})
    model = tp.parallelize(model, mesh, plan=plan)  # in place; weights taken from rank 0

    data = TensorDataset(torch.randn(256, 16, 128, generator=torch.Generator().manual_seed(0)))
    sampler = tp.TensorParallelSampler(data, mesh)  # the same batches on every tensor-parallel rank
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            x = x.to(device)
            loss = (model(x) - x.flip(-1)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}")
    if dist.get_rank() == 0:
        local = model[0].up.weight.to_local()
        print(f"rank 0 holds up.weight {tuple(local.shape)} of {tuple(model[0].up.weight.shape)}")
    dist.barrier()  # let every rank finish before the group goes away
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
